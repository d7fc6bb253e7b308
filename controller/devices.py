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


def pin_threads() -> int:
    """Share this machine's cores between the ranks of this node, so they do not fight."""
    cores = len(os.sched_getaffinity(0))
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    n = max(1, cores // local_ranks)
    torch.set_num_threads(n)
    return n


def init_distributed(spec: DeviceSpec, *, timeout: timedelta) -> torch.device:
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if spec.type == "cpu":
        device = torch.device("cpu")
    else:
        device = torch.device(spec.type, local_rank)
        getattr(torch, spec.type).set_device(device)
    dist.init_process_group(backend=spec.pg_backend, timeout=timeout)
    return device
