"""What megatron-core 0.16.1 needs to run on a CPU-only torch; applied only when the device is CPU
(`apply()`), never on GPU/NPU. Each shim names the megatron functions it serves;
tests/test_megatron.py checks that each is still needed (megatron fails without it) and that it
works (megatron runs with it)."""
from __future__ import annotations

import warnings

import torch

_applied = False


def _cpu_device() -> str:
    return "cpu"


def apply() -> None:
    """Idempotent; process-wide (megatron reads these at call time)."""
    global _applied
    if _applied:
        return
    # megatron's import-time notes about CUDA-only kernels (Transformer Engine, Apex, CUDA graphs, CUDA
    # connections) say nothing on a CPU: silenced here, before megatron is imported, and only on CPU
    for note in ("Transformer Engine and Apex are not installed", "Apex is not installed", "full scope is deprecated",
                 "When using async grad allreduce it is recommended to set the environment variable CUDA_DEVICE"):
        warnings.filterwarnings("ignore", message=note, category=UserWarning)
    from megatron.core.tensor_parallel import random as mrandom

    # 1. torch.cuda.current_device(): the device of the buffers megatron allocates itself:
    #    RotaryEmbedding (inv_freq), tensor_parallel.mappings (all-gather / reduce-scatter outputs),
    #    tensor_parallel.layers (weight init, gradient buffers). On CPU, 'cpu'.
    torch.cuda.current_device = _cpu_device
    # 2. The CUDA RNG state the tensor-parallel RNG tracker forks (CudaRNGStatesTracker.add/fork,
    #    used by DotProductAttention's dropout region): the CPU generator's state instead.
    mrandom._get_cuda_rng_state = lambda *args, **kwargs: torch.get_rng_state()
    mrandom._set_cuda_rng_state = lambda state, *args, **kwargs: torch.set_rng_state(state)
    _applied = True


def seed_tracker(seed: int) -> None:
    """megatron's model_parallel_cuda_manual_seed, on the CPU generator: the tracker's
    'model-parallel-rng' state is `seed` + 2718 (megatron's offset), the global state is kept."""
    from megatron.core.tensor_parallel import random as mrandom

    tracker = mrandom.get_cuda_rng_tracker()
    tracker.reset()
    kept = torch.get_rng_state()
    torch.manual_seed(seed + 2718)
    tracker.states_[mrandom._MODEL_PARALLEL_RNG_TRACKER_NAME] = torch.get_rng_state()
    torch.set_rng_state(kept)
