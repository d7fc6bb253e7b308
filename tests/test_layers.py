"""The house's layers, checked from the code's own imports (DESIGN.md "Layout").

    launch -> recipes -> controller -> executors -> channels, algorithms -> common
Each package may import only the packages listed for it; a deferred import inside a function
counts too. The CLI and --dry-run load no model code.
"""
from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("common", "algorithms", "channels", "executors", "controller", "recipes", "launch")

# what each package (and the folders users copy from) may import of the project
ALLOWED = {
    "common": set(),
    "algorithms": {"common"},
    "channels": {"common"},
    "executors": {"common", "channels", "algorithms"},
    "controller": {"common", "channels", "executors"},
    "recipes": {"common", "algorithms", "channels", "executors", "controller"},
    "launch": {"common", "algorithms", "channels", "executors", "controller", "recipes"},
    "examples": {"common", "algorithms", "channels", "executors", "controller", "recipes"},
    "bench": {"common", "algorithms", "channels", "executors", "controller", "recipes"},
}
# executors reach channels for payload types only (DESIGN.md), and only the trainer runs algorithms
NARROW = {
    ("executors", "channels"): {"channels.payloads"},
}
ALGORITHM_USERS = ("executors/trainer/",)


def _imports(path: Path) -> list[tuple[int, str]]:
    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            out.append((node.lineno, node.module))
    return out


def _violations() -> list[str]:
    bad = []
    for layer, allowed in ALLOWED.items():
        for path in sorted((ROOT / layer).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for line, module in _imports(path):
                top = module.split(".")[0]
                if top not in PACKAGES + ("tests",) or top == layer:
                    continue
                narrow = NARROW.get((layer, top))
                if top not in allowed:
                    bad.append(f"{rel}:{line} imports {module} ({layer} may not import {top})")
                elif narrow and module not in narrow:
                    bad.append(f"{rel}:{line} imports {module} ({layer} may import only {sorted(narrow)} of {top})")
                elif layer == "executors" and top == "algorithms" and not rel.startswith(ALGORITHM_USERS):
                    bad.append(f"{rel}:{line} imports {module} (only the trainer runs algorithms)")
    return bad


def test_every_import_follows_the_layers():
    assert _violations() == []


def test_the_checker_sees_a_violation(tmp_path, monkeypatch):
    """The rules can fail: a channels module importing an executor is reported with its line."""
    fake = tmp_path / "channels"
    fake.mkdir()
    (fake / "bad.py").write_text("import torch\n\nfrom executors.base import Executor\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    assert _violations() == ["channels/bad.py:3 imports executors.base (channels may not import executors)"]


_PROBE = """
import contextlib, io, sys
from launch.cli import main
with contextlib.redirect_stdout(io.StringIO()) as out:
    code = main(sys.argv[1:])
heavy = [m for m in ("transformers", "torch.distributed.tensor", "executors.trainer.models",
                     "executors.trainer.packed_attention") if m in sys.modules]
print(code, "phases" if "1. prompts" in out.getvalue() else "no-phases", heavy)
"""


@pytest.mark.parametrize("args", [["--algo", "grpo", "--dry-run"],
                                  ["--algo", "dapo", "--dry-run", "--set", "trainer.dp=2"]])
def test_cli_and_dry_run_load_no_model_code(args):
    proc = subprocess.run([sys.executable, "-c", _PROBE, *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.stdout.split("\n")[0] == "0 phases []", proc.stdout + proc.stderr
