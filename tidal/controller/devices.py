"""One place decides the device and the process-group backend: Ascend, CUDA, else CPU."""
from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DeviceSpec:
    type: str  # "npu" | "cuda" | "cpu"
    backend: str  # "hccl" | "nccl" | "gloo"

    @property
    def pg_backend(self) -> str:
        # CPU tensors (channel bodies, metadata) keep using gloo next to the device backend.
        return "gloo" if self.type == "cpu" else f"cpu:gloo,{self.type}:{self.backend}"


def detect_device() -> DeviceSpec:
    if importlib.util.find_spec("torch_npu") is not None:
        import torch_npu  # noqa: F401  (registers torch.npu)

        if torch.npu.is_available():
            return DeviceSpec("npu", "hccl")
    if torch.cuda.is_available():
        return DeviceSpec("cuda", "nccl")
    return DeviceSpec("cpu", "gloo")


def device_count() -> int:
    """This machine's GPUs/NPUs, else its CPU cores: what `--plan` splits by default."""
    spec = detect_device()
    if spec.type != "cpu":
        return getattr(torch, spec.type).device_count()
    return len(os.sched_getaffinity(0))


def pin_threads() -> int:
    """Share this machine's cores between the ranks of this node, so they do not fight. TIDAL_THREADS
    sets the count instead: a CPU kernel's float sums follow its threads, so two runs compare bit for
    bit (e.g. one process co-located against three split) only with the same threads per rank."""
    if os.environ.get("TIDAL_THREADS"):
        n = int(os.environ["TIDAL_THREADS"])
        torch.set_num_threads(n)
        return n
    cores = len(os.sched_getaffinity(0))
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    n = max(1, cores // local_ranks)
    torch.set_num_threads(n)
    return n


def take_peak_gb(device: torch.device) -> float | None:
    """The most accelerator memory this process's tensors held since the last call (the caching
    allocator's high-water mark, in GB), and a new watermark from now; None on the CPU, whose
    allocations torch does not count."""
    if device.type == "cpu":
        return None
    accel = getattr(torch, device.type)
    peak = accel.max_memory_allocated(device)
    accel.reset_peak_memory_stats(device)
    return peak / 1e9


def attempt() -> int:
    """torchrun's restart count: 0, then 1, 2, ... after each elastic restart of the workers."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _job_store(timeout: timedelta) -> dist.Store:
    """The process groups' store, its keys under this attempt's prefix.

    Not env://: under torchrun the workers share the agent's store, which outlives an elastic
    restart, and torch 2.13 adds no per-attempt prefix there, so a restarted gloo group met the
    dead attempt's keys and hung in init_process_group (measured: --max-restarts 1 with the
    default and the --standalone rendezvous). Outside torchrun rank 0 hosts the store, as env:// does.
    """
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == str(True)
    store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]),
                          world_size=int(os.environ["WORLD_SIZE"]),
                          is_master=not agent and os.environ.get("RANK", "0") == "0", timeout=timeout)
    return dist.PrefixStore(f"pg/{attempt()}", store)


def init_distributed(spec: DeviceSpec, *, timeout: timedelta, index: int | None) -> torch.device:
    """`index`: this rank's accelerator, from the placement (tidal/controller/world.py device_index); None:
    a rank whose executors compute on the CPU only (it joins only gloo groups)."""
    if spec.type == "cpu" or index is None:
        device = torch.device("cpu")
    else:
        device = torch.device(spec.type, index)
        getattr(torch, spec.type).set_device(device)
    dist.init_process_group(backend=spec.pg_backend, timeout=timeout, store=_job_store(timeout),
                            rank=int(os.environ.get("RANK", "0")), world_size=int(os.environ["WORLD_SIZE"]))
    return device
