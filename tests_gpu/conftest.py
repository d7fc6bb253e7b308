"""The GPU suite (run by `make gpu-check`): what only an accelerator exercises.

Every test takes the `device` fixture: this machine's first CUDA (or Ascend) device, else the test
is skipped with the reason. TIDAL_GPU_SUITE_DEVICE=cpu runs the suite's code on the CPU instead (a
check of the suite itself on a machine without one; device-only parts skip). Tests that need more
devices than the machine has skip with the count they need. Whole jobs add their step times to one
table, printed at the end of the session.
"""
from __future__ import annotations

import importlib.util
import json
import os

import pytest
import torch
from tabulate import tabulate

import tidal.common.spawn  # noqa: E402
import tests.e2e  # noqa: E402

# ranks that exit as processes do (spawned, torchrun), as this suite first ran on a GPU: no os._exit
# from a fork server or the warm launcher around CUDA and NCCL teardown
tidal.common.spawn.START_METHOD = "spawn"
tests.e2e.WARM = False

STEP_TIMES: list[list] = []  # [job, device, steps, median step s, tokens/s]


def accelerator() -> torch.device | None:
    if importlib.util.find_spec("torch_npu") is not None:
        import torch_npu  # noqa: F401

        if torch.npu.is_available():
            return torch.device("npu", 0)
    if torch.cuda.is_available():
        return torch.device("cuda", 0)
    return None


def device_count() -> int:
    dev = accelerator()
    return 0 if dev is None else getattr(torch, dev.type).device_count()


@pytest.fixture(scope="session")
def device() -> torch.device:
    dev = accelerator()
    if dev is not None:
        return dev
    if os.environ.get("TIDAL_GPU_SUITE_DEVICE") == "cpu":
        return torch.device("cpu")
    pytest.skip("no GPU/NPU on this machine (TIDAL_GPU_SUITE_DEVICE=cpu runs the suite's code on the CPU)")


def needs_devices(n: int):
    """Skip unless this machine has `n` accelerators (the CPU stand-in counts as 1)."""
    have = device_count() or (1 if os.environ.get("TIDAL_GPU_SUITE_DEVICE") == "cpu" else 0)
    return pytest.mark.skipif(have < n, reason=f"needs {n} devices, this machine has {have}")


def pytest_terminal_summary(terminalreporter):
    if STEP_TIMES:
        terminalreporter.write_line("\nstep times (tests_gpu):")
        terminalreporter.write_line(tabulate(STEP_TIMES, headers=["job", "device", "steps", "median step s",
                                                                   "tokens/s"], floatfmt=".3g"))


def _record(line: dict) -> None:
    """One JSON line into $TIDAL_GPU_SUITE_LOG, written at once: what bench/gpu_check.py reports, kept
    even when the check's deadline ends the session before pytest's own summary (a lent GPU's
    minutes are few: a cut run must still say which test failed, and how)."""
    path = os.environ.get("TIDAL_GPU_SUITE_LOG")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")


def pytest_runtest_logstart(nodeid, location):
    _record({"test": nodeid, "outcome": "started"})


def pytest_runtest_logreport(report):
    if report.when == "call" or report.outcome != "passed":  # a setup's skip or error, a teardown's error
        outcome = "error" if report.when != "call" and report.failed else report.outcome
        why = report.longrepr[2] if report.skipped and isinstance(report.longrepr, tuple) else report.longreprtext
        _record({"test": report.nodeid, "outcome": outcome, "s": report.duration, "why": why[-4000:]})
