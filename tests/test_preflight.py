"""Bad input fails before any rank starts: one line naming the field or file, exit 2, in seconds; and
`python launch.py` starts the ranks itself."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e import ROOT, SMALL, metrics


def _launch(*args: str, timeout: float = 300) -> tuple[subprocess.CompletedProcess, float]:
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "launch.py", "--algo", "grpo", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout)
    return proc, time.monotonic() - t0


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from executors.hf import load_model, load_tokenizer, save_hf

    path = tmp_path_factory.mktemp("model")
    save_hf(load_model(None), load_tokenizer(None), path)
    return path


def _copy_without(model_dir: Path, tmp: Path, *names: str) -> Path:
    out = tmp / "model"
    out.mkdir(parents=True)
    for f in model_dir.iterdir():
        if f.name not in names:
            (out / f.name).write_bytes(f.read_bytes())
    return out


def _cases(model_dir: Path, tmp: Path):
    data = tmp / "prompts.jsonl"
    data.write_text('{"prompt": "1+1?", "answer": "2"}\n{"prompt": 5}\n')
    a_file = tmp / "a_file"
    a_file.write_text("x")
    held = tmp / "held"
    held.mkdir()
    (held / "metrics.jsonl").write_text("{}\n")
    yield "missing data", ["--set", f"data.path={tmp / 'nope.jsonl'}"], "nope.jsonl' does not exist"
    yield "bad data line", ["--set", f"data.path={data}"], f"data.path: {data}:2: field 'prompt'"
    yield "no config.json", ["--set", f"model.path={_copy_without(model_dir, tmp / 'c', 'config.json')}"], \
        "expected"
    yield "no weights", ["--set", f"model.path={_copy_without(model_dir, tmp / 'w', 'model.safetensors')}"], \
        "has no weights (looked for model.safetensors"
    yield "no tokenizer", ["--set", f"model.path={_copy_without(model_dir, tmp / 't', 'tokenizer.json')}"], \
        "has no tokenizer"
    yield "output dir is a file", ["--output-dir", str(a_file)], f"output dir {a_file} is a file, not a directory"
    yield "output dir holds a run", ["--output-dir", str(held)], \
        f"output dir {held} already holds a run (metrics.jsonl); pass --resume to continue it or --overwrite"
    yield "one sample per prompt", ["--set", "generator.samples_per_prompt=1"], \
        "generator.samples_per_prompt=1 with --algo grpo"
    yield "resume and overwrite", ["--output-dir", str(held), "--resume", "--overwrite"], \
        "--resume and --overwrite together"


def test_each_bad_input_is_one_line_before_start(model_dir, tmp_path):
    (tmp_path / "cases").mkdir()
    times = {}
    for name, args, message in _cases(model_dir, tmp_path / "cases"):
        proc, took = _launch(*args, "--steps", "1")
        times[name] = round(took, 1)
        assert proc.returncode == 2, (name, proc.returncode, proc.stderr[-2000:])
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], (name, proc.stderr)
        assert took < 60, (name, took)  # measured 2-4 s on a quiet machine; a hang guard here
    print("seconds to the error:", times)


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes through a read-only mode")
def test_unwritable_output_parent(tmp_path):
    locked = tmp_path / "locked"
    locked.mkdir(mode=0o500)
    proc, _ = _launch("--output-dir", str(locked / "run"))
    assert proc.returncode == 2 and f"cannot be created: {locked} is not writable" in proc.stderr


def test_python_launch_starts_the_ranks_itself(tmp_path):
    proc, _ = _launch("--steps", "2", "--output-dir", str(tmp_path), *SMALL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [r["step"] for r in metrics(tmp_path)] == [0, 1]
    assert "ChildFailedError" not in proc.stderr and "Traceback" not in proc.stderr
