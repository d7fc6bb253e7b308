"""The trainer's backends (`trainer.backend`): one `register` line each. Light on purpose: the CLI
checks a config against its backend without loading model code; `models()` imports it on the
trainer's ranks only."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from tidal.common.registry import Registry
from tidal.executors.trainer.config import TrainerConfig


@dataclass(frozen=True)
class Backend:
    # its models class, with `build` (tidal/executors/trainer/models.py TriModel for torch): what the trainer calls on
    # it is tidal/executors/trainer/interface.py TrainerModels
    models: Callable[[], type]
    # (trainer config, model path) -> None, or ValueError naming the field: before any rank starts
    check: Callable[[TrainerConfig, str | None], None]
    # each rank saves its own optimizer shard: a resume keeps the (dp, tp, pp) it was saved under
    per_rank_optimizer: bool = False  # and AdamW is sharded over dp (ZeRO-1): tidal/launch/memory.py counts a share
    expert_parallel: bool = False  # it can split an MoE model's experts over dp (trainer.ep)
    lora: bool = False  # it can train LoRA adapters (trainer.lora)
    pipeline: bool = False  # it can cut the model into pipeline stages (trainer.pp)
    fp16: bool = False  # it trains with fp16 compute under a dynamic loss scale (trainer.precision=fp16)
    # its layers compute with tidal/modeling/numerics.py's batch-invariant products and attention (model.numerics=exact)
    exact: bool = False
    context_parallel: bool = False  # it can split a packed row's tokens over cp ranks (trainer.cp)
    entropy_bonus: bool = False  # its head's entropy has a gradient (algorithm.entropy_coef)
    about: str = ""


def _torch_models() -> type:
    from tidal.executors.trainer.models import TriModel

    return TriModel


def _megatron_models() -> type:
    from tidal.executors.trainer.megatron_models import MegatronTriModel

    return MegatronTriModel


def _no_check(cfg: TrainerConfig, model_path: str | None) -> None:
    pass


def _check_megatron(cfg: TrainerConfig, model_path: str | None) -> None:
    """megatron-core is installed and converts this model (config.json only); its own limits."""
    import importlib.util

    if cfg.fsdp:
        raise ValueError("trainer.fsdp: the megatron backend shards the optimizer over dp itself; "
                         "set trainer.fsdp=false")
    if importlib.util.find_spec("megatron") is None or importlib.util.find_spec("megatron.core") is None:
        raise ValueError("trainer.backend=megatron needs megatron-core: pip install -e \".[megatron]\" "
                         "(megatron-core 0.16.1 on Python 3.11; `make install` includes it)")
    from tidal.modeling.hf import load_config
    from tidal.modeling.megatron.model import check_supported

    config = load_config(model_path)
    check_supported(config)
    if cfg.pp > 1:
        from tidal.modeling.megatron.stages import check_stages

        check_stages(layers=config.num_hidden_layers, pp=cfg.pp)


BACKENDS: Registry[Backend] = Registry("trainer backend", key="trainer.backend", plugin=Backend)
BACKENDS.register("torch", Backend(models=_torch_models, check=_no_check, expert_parallel=True, lora=True, fp16=True,
                                   exact=True, context_parallel=True, entropy_bonus=True,
                                   about="HF model classes with DTensor tp and FSDP2"))
BACKENDS.register("megatron", Backend(models=_megatron_models, check=_check_megatron, per_rank_optimizer=True,
                                      pipeline=True,
                                      about="megatron-core's GPTModel (the megatron extra; Qwen3/Qwen2/Llama), tp, "
                                            "pp, and dp with a ZeRO-1 optimizer"))
