"""A whole job under torchrun for the benches: one run into a directory, its metrics rows back."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.spawn import free_port  # noqa: E402


def run_job(out: Path, *, nproc: int = 3, steps: int, overrides: list[str], args: tuple[str, ...] = (),
            timeout: float = 900) -> list[dict]:
    """`launch.py --algo grpo` on `nproc` ranks with `--set` each of `overrides` (and `args`); exits
    with the job's stderr if it fails or outlives `timeout` seconds."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={free_port()}",
           "launch.py", "--algo", "grpo", "--steps", str(steps), "--output-dir", str(out), "--overwrite", *args]
    for o in overrides:
        cmd += ["--set", o]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    if proc.returncode:
        raise SystemExit(f"run failed ({overrides} {args}):\n{proc.stderr[-3000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
