"""Run a job from Python: `run("grpo", overrides={...}, steps=20)` starts its ranks, waits, and hands back
the output directory and the metrics rows. What a user scripting sweeps wants, and what the tests and
the benchmarks use (one launcher for all three).

Without `nproc` the job runs as `python launch.py` does: it starts the placement's ranks itself on this
machine. With `nproc` it runs under torch's launcher, `torchrun --nproc-per-node nproc` (the path a
multi-node user takes), on a free local port. With `warm=True` as well, its ranks are forked from one
process that has imported Tidal once (tidal/launch/warm.py): many short jobs in a row start in a fraction of the
time (the tests run that way; what needs torchrun's agent, restarts or a signal to the launcher, does not).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

from tidal.common.spawn import free_port

ROOT = Path(__file__).resolve().parents[2]


@dataclass(frozen=True)
class Job:
    output_dir: Path
    returncode: int
    stdout: str
    stderr: str

    @property
    def metrics(self) -> list[dict]:
        """metrics.jsonl's rows, one a step."""
        return read_metrics(self.output_dir)


class JobFailed(RuntimeError):
    """A job that exited with an error: its exit code and the end of what it printed."""


def read_metrics(output_dir: Path | str) -> list[dict]:
    path = Path(output_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []


def command(algo: str = "grpo", *args: str, overrides: Mapping[str, object] | Sequence[str] = (),
            steps: int | None = None, output_dir: Path | str | None = None, nproc: int | None = None,
            launcher_args: Sequence[str] = ()) -> list[str]:
    """The command line of a job: `overrides` as --set key=value (a mapping, or "key=value" strings),
    then `args` as they are (any other flag of launch.py). `launcher_args`: torchrun's own flags
    (e.g. --max-restarts=1), with `nproc`."""
    sets = [f"{k}={_yaml(v)}" for k, v in overrides.items()] if isinstance(overrides, Mapping) else list(overrides)
    assert nproc is not None or not launcher_args, "torchrun's flags need nproc (a torchrun launch)"
    launcher = ([sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={free_port()}",
                 *launcher_args] if nproc is not None else [sys.executable])
    return [*launcher, str(ROOT / "launch.py"), "--algo", algo,
            *(["--steps", str(steps)] if steps is not None else []),
            *(["--output-dir", str(output_dir)] if output_dir is not None else []),
            *[a for s in sets for a in ("--set", s)], *args]


def run(algo: str = "grpo", *args: str, overrides: Mapping[str, object] | Sequence[str] = (), steps: int | None = None,
        output_dir: Path | str | None = None, nproc: int | None = None, timeout: float | None = None,
        env: Mapping[str, str] | None = None, check: bool = True, warm: bool = False) -> Job:
    """Run the job to its end. `env`: added to this process's environment (e.g. TIDAL_THREADS=1).
    check: raise JobFailed when it fails (else look at the returned Job's returncode). warm: fork the
    `nproc` ranks from the warm launcher instead of starting torchrun."""
    if output_dir is None:
        import time

        output_dir = ROOT / "runs" / time.strftime("%Y%m%d-%H%M%S")
    cmd = command(algo, *args, overrides=overrides, steps=steps, output_dir=output_dir, nproc=nproc)
    if warm:
        returncode, stdout, stderr = _run_warm(cmd, nproc=nproc, timeout=timeout, env=env)
    else:
        proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **(env or {})})
        returncode, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    job = Job(Path(output_dir), returncode, stdout, stderr)
    if check and returncode:
        raise JobFailed(f"the {algo} job in {output_dir} exited with {returncode}:\n{stderr[-3000:]}")
    return job


def run_script(script: Path | str, *args: str, nproc: int, timeout: float | None = None,
               env: Mapping[str, str] | None = None) -> tuple[int, str, str]:
    """A script that wires its own graph (examples/) on `nproc` ranks forked by the warm launcher, as
    `torchrun --nproc-per-node nproc script args` runs it: (exit code, stdout, stderr)."""
    import tempfile

    from tidal.launch import warm

    with tempfile.TemporaryDirectory(prefix="tidal-job-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        code = warm.shared().run(list(args), nproc=nproc, port=free_port(), out=out, err=err, env=env, timeout=timeout,
                                 script=script)
        read = lambda path: path.read_text(errors="replace") if path.is_file() else ""  # noqa: E731
        return code, read(out), read(err)


def _run_warm(cmd: list[str], *, nproc: int | None, timeout: float | None,
              env: Mapping[str, str] | None) -> tuple[int, str, str]:
    assert nproc is not None, "warm=True forks nproc ranks: give nproc"
    script = ROOT / "launch.py"
    return run_script(script, *cmd[cmd.index(str(script)) + 1:], nproc=nproc, timeout=timeout, env=env)


def start(algo: str = "grpo", *args: str, overrides: Mapping[str, object] | Sequence[str] = (),
          steps: int | None = None, output_dir: Path | str | None = None, nproc: int | None = None,
          launcher_args: Sequence[str] = (), env: Mapping[str, str] | None = None) -> subprocess.Popen:
    """The job in the background (to signal or watch it), its output piped."""
    return subprocess.Popen(command(algo, *args, overrides=overrides, steps=steps, output_dir=output_dir, nproc=nproc,
                                    launcher_args=launcher_args),
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, **(env or {})})


def _yaml(value) -> str:
    """A Python value as --set reads it (YAML): True as true, None as null, lists as [a, b]."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_yaml(v) for v in value) + "]"
    return str(value)
