"""A warm launcher: one process imports torch, transformers and Tidal once, then forks each job's ranks.

Why: a small job's ranks spend most of their life importing. On 2 cores, a 3-rank embedded job takes
~18 CPU-seconds of which the 3 steps are ~1: torch's launcher and every rank import torch (~1 s each),
then transformers, the trainer's DTensor and attention modules (~3 s a rank). A forked rank starts with
all of that already in memory, so many short jobs in a row (a test suite, a sweep of tiny runs) cost
what their steps cost.

What a rank sees is what torchrun gives it: the same environment variables (RANK, LOCAL_RANK,
WORLD_SIZE, MASTER_ADDR/PORT, TORCHELASTIC_RUN_ID, ...), argv, working directory and standard streams,
and it runs the script (launch.py, or a script wiring its own graph) as `python script ...` would. What differs: no elastic agent (no restarts; on the
first rank that fails, the others get SIGTERM as torchrun's agent sends it, then SIGKILL after
`stop_timeout_s`), and the job's exit code is its first failed rank's (128 + N for a signal N), as
`python launch.py` reports it. Use torchrun for what needs the agent (restarts, signals to the launcher),
and for the vLLM engine: a rank ends by os._exit, which skips exit-time cleanup done in C++ (vLLM's CPU
shared memory; on a GPU, CUDA and NCCL teardown).

Fork safety: the server forks only while it is single-threaded (checked after its imports: no
OpenMP pool, no tokenizer pool), and a rank reseeds Python's and numpy's global generators as a fresh
process would have them. Protocol: one JSON line a job on stdin; the server answers the ranks' pids,
then the exit code.
"""
from __future__ import annotations

import atexit
import importlib
import json
import os
import pkgutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Mapping, Sequence

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "launch.py"
# what a job's ranks import on the way (the HF model classes are found by name at load time)
LIBRARIES = ("transformers", "transformers.models.qwen3.modeling_qwen3", "transformers.models.auto.modeling_auto",
             "torch.distributed.tensor", "torch.distributed.fsdp", "safetensors.torch", "peft")


class WarmLauncher:
    """The client: starts the server (`python -m tidal.launch.warm`) on first use and runs jobs through it."""

    def __init__(self) -> None:
        self._server: subprocess.Popen | None = None

    def _start(self) -> subprocess.Popen:
        if self._server is None or self._server.poll() is not None:
            env = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}  # as torchrun's ranks
            self._server = subprocess.Popen([sys.executable, "-m", "tidal.launch.warm"], cwd=ROOT, env=env, text=True,
                                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            ready = self._server.stdout.readline()
            if not ready.startswith("ready"):
                raise RuntimeError(f"the warm launcher did not start: {ready!r}")
        return self._server

    def run(self, argv: Sequence[str], *, nproc: int, port: int, out: Path, err: Path,
            env: Mapping[str, str] | None = None, timeout: float | None = None, script: Path | str = SCRIPT) -> int:
        """Run `script argv` (launch.py, or a script of one's own graph, e.g. examples/) on `nproc` forked
        ranks, their stdout/stderr into `out`/`err`; the exit code. On `timeout` the ranks are killed and
        subprocess.TimeoutExpired raised (as subprocess.run does)."""
        server = self._start()
        # the whole environment, as subprocess would pass it (libraries read theirs at import: the server's)
        request = {"script": str(Path(script).resolve()), "argv": list(argv), "nproc": nproc, "port": port,
                   "out": str(out), "err": str(err), "env": {**os.environ, **(env or {})}, "cwd": str(ROOT)}
        server.stdin.write(json.dumps(request) + "\n")
        server.stdin.flush()
        pids = json.loads(server.stdout.readline())["pids"]
        done: list[str] = []
        reader = threading.Thread(target=lambda: done.append(server.stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout)
        if reader.is_alive():  # our own ranks, by pid; the server reaps them and answers
            _signal(pids, signal.SIGKILL)
            reader.join(30)
            raise subprocess.TimeoutExpired([str(script), *argv], timeout)
        if not done or not done[0]:
            raise RuntimeError("the warm launcher died")
        return json.loads(done[0])["returncode"]

    def close(self) -> None:
        if self._server is not None and self._server.poll() is None:
            self._server.stdin.close()
            try:
                self._server.wait(30)
            except subprocess.TimeoutExpired:
                self._server.kill()


_shared: WarmLauncher | None = None


def shared() -> WarmLauncher:
    """This process's warm launcher (one server, closed at exit)."""
    global _shared
    if _shared is None:
        _shared = WarmLauncher()
        atexit.register(_shared.close)
    return _shared


# --- the server ---------------------------------------------------------------------------------------

def _preload() -> None:
    """Import what the ranks will: every Tidal module that imports here (an optional engine or backend
    whose library is not installed is skipped, as a job would not import it either) and the libraries."""
    import tidal

    for info in pkgutil.walk_packages(tidal.__path__, prefix="tidal."):
        if info.name == __name__:
            continue
        try:
            importlib.import_module(info.name)
        except ImportError:
            pass
    for name in LIBRARIES:
        try:
            importlib.import_module(name)
        except ImportError:
            pass


def _threads() -> int:
    return len(os.listdir("/proc/self/task")) if os.path.isdir("/proc/self/task") else threading.active_count()


def _rank(request: dict, rank: int, run_id: str) -> None:
    """In the forked child: become rank `rank` of the job, run the script as `python script argv` would
    (as __main__, its folder first on sys.path), and exit (never return)."""
    code = 1
    try:
        os.setpgid(0, 0)  # its own group: a Ctrl-C at the client's terminal reaches the client only
        n = request["nproc"]
        os.environ.clear()
        os.environ.update(request["env"])
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # as torchrun sets it for several local ranks
        os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", ROLE_RANK=str(rank),
                          ROLE_NAME="default", WORLD_SIZE=str(n), LOCAL_WORLD_SIZE=str(n), ROLE_WORLD_SIZE=str(n),
                          GROUP_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(request["port"]),
                          TORCHELASTIC_RUN_ID=run_id, TORCHELASTIC_RESTART_COUNT="0", TORCHELASTIC_MAX_RESTARTS="0")
        os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)  # rank 0 holds the store, as with no agent
        os.chdir(request["cwd"])
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        for fd, path in ((1, request["out"]), (2, request["err"])):
            os.dup2(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644), fd)
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGPIPE):
            signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)
        import random

        import numpy as np

        random.seed()  # a fresh process's generators, not the server's
        np.random.seed()
        import runpy

        sys.argv = [request["script"], *request["argv"]]
        sys.path[0] = str(Path(request["script"]).parent)
        runpy.run_path(request["script"], run_name="__main__")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code or 0)


def _wait(pids: list[int], stop_timeout_s: float) -> int:
    """Reap the ranks; on the first failure SIGTERM the rest (SIGKILL after stop_timeout_s). -> exit code."""
    codes: dict[int, int] = {}
    first, kill_at = None, None
    while len(codes) < len(pids):
        # block until a rank ends; poll only while a SIGKILL deadline is pending
        pid, status = os.waitpid(-1, 0 if kill_at is None else os.WNOHANG)
        if pid == 0:
            if time.monotonic() > kill_at:
                _signal([p for p in pids if p not in codes], signal.SIGKILL)
                kill_at = None
            time.sleep(0.02)
            continue
        if pid not in pids:
            continue
        code = os.waitstatus_to_exitcode(status)
        codes[pid] = 128 - code if code < 0 else code
        if codes[pid] and first is None:
            first = codes[pid]
            _signal([p for p in pids if p not in codes], signal.SIGTERM)
            kill_at = time.monotonic() + stop_timeout_s
    return first or 0


def _signal(pids: list[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def serve() -> None:
    _preload()
    if _threads() != 1:
        raise SystemExit(f"tidal.launch.warm: {_threads()} threads after the imports; forking is not safe")
    print("ready", flush=True)
    for n, line in enumerate(sys.stdin):
        request = json.loads(line)
        run_id = f"warm-{os.getpid()}-{n}"
        pids = []
        for rank in range(request["nproc"]):
            pid = os.fork()
            if pid == 0:
                _rank(request, rank, run_id)
            pids.append(pid)
        print(json.dumps({"pids": pids}), flush=True)
        print(json.dumps({"returncode": _wait(pids, stop_timeout_s=30)}), flush=True)


if __name__ == "__main__":
    serve()
