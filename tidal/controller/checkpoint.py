"""Checkpoints that are whole or absent: written to a hidden temporary directory, committed by the
last rank to finish (manifest written last, fsynced, renamed into place), pruned to the newest K.

    <run>/checkpoints/.tmp.step_000009/   every executor writes its part here (most write nothing)
    <run>/checkpoints/step_000009/        after the commit: the parts + manifest.json
    manifest.json                         {"step", "config_sha256", "files": {relpath: [size, sha256]}}

A directory without a valid manifest is never resumed from: the rename happens only after every file
and the manifest are on disk, so a crash leaves a `.tmp.*` directory (removed when that step is saved
again) or nothing.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tidal.common.files import readable_as_umask
from tidal.executors.generator.config import GeneratorConfig

MANIFEST = "manifest.json"
_STEP_DIR = re.compile(r"step_(\d{6,})$")
# settings a resumed run may change: where and how it runs, not what it computes
RESUMABLE_CHANGES = ("steps", "output_dir", "timeout_s", "stop_timeout_s", "checkpoint_every", "checkpoint_minutes",
                     "checkpoint_keep", "trainer.dp", "trainer.cp", "trainer.tp", "trainer.pp", "trainer.pp_drain", "trainer.fsdp", "trainer.ep", "trainer.lora.merged", "critic.dp", "critic.cp", "critic.tp", "critic.fsdp", "generator.replicas",
                     "generator.tp", "generator.engine", "generator.max_batch_prompts",
                     "generator.admission", "generator.kv_budget_tokens", "generator.kv_memory_fraction",
                     "reward.replicas", "reward.timeout_s", "logging")


def step_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f"step_{step:06d}"


def tmp_dir(run_dir: Path, step: int) -> Path:
    return run_dir / "checkpoints" / f".tmp.step_{step:06d}"


def config_sha256(config: dict) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def commit(run_dir: Path, step: int, *, config: dict, keep: int) -> Path:
    """Seal `.tmp.step_N` as `step_N`: modes, hashes, fsync, manifest last, rename; then prune."""
    tmp, final = tmp_dir(run_dir, step), step_dir(run_dir, step)
    tmp.mkdir(parents=True, exist_ok=True)  # a graph whose executors hold no state writes nothing else
    def seal(path: Path) -> list:
        readable_as_umask(path)
        _fsync(path)
        return [path.stat().st_size, _sha256(path)]

    paths = sorted(p for p in tmp.rglob("*") if p.is_file())
    # hashlib releases the GIL on large reads: the files (one optimizer shard per trainer rank, the
    # weights) hash in parallel, ~0.9 GB/s per core here
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        files = dict(zip((str(p.relative_to(tmp)) for p in paths), pool.map(seal, paths)))
    (tmp / "run_config.json").write_text(json.dumps(config, indent=2))
    files["run_config.json"] = [(tmp / "run_config.json").stat().st_size, _sha256(tmp / "run_config.json")]
    manifest = tmp / MANIFEST
    manifest.write_text(json.dumps({"step": step, "config_sha256": config_sha256(config), "files": files}, indent=1))
    for path in (tmp / "run_config.json", manifest):
        readable_as_umask(path)
        _fsync(path)
    for sub in {p.parent for p in tmp.rglob("*")} | {tmp}:
        _fsync(sub)
    if final.exists():  # the same step saved again (a resumed run that reached it once more)
        shutil.rmtree(final)
    os.replace(tmp, final)
    _fsync(final.parent)
    prune(run_dir, keep=keep)
    return final


def prune(run_dir: Path, *, keep: int) -> None:
    """Keep the newest `keep` complete checkpoints (0: keep all)."""
    if keep > 0:
        for path in complete_checkpoints(run_dir)[:-keep]:
            shutil.rmtree(path)


@dataclass(frozen=True)
class Checkpoint:
    path: Path
    step: int  # the last step it holds: a resumed run starts at step + 1
    config: dict


def complete_checkpoints(run_dir: Path) -> list[Path]:
    """Committed checkpoint directories (a manifest present), oldest first."""
    root = run_dir / "checkpoints"
    found = [p for p in root.iterdir() if _STEP_DIR.match(p.name) and (p / MANIFEST).is_file()] if root.is_dir() else []
    return sorted(found, key=lambda p: int(_STEP_DIR.match(p.name).group(1)))


def open_checkpoint(path: Path, *, hashes: bool) -> Checkpoint:
    """A committed checkpoint, verified against its manifest (sizes always, sha256 if `hashes`);
    ValueError naming the missing or wrong file."""
    manifest = path / MANIFEST
    if not manifest.is_file():
        raise ValueError(f"checkpoint {path}: no {MANIFEST} (not a checkpoint, or one that was never completed)")
    try:
        meta = json.loads(manifest.read_text())
        step, files = int(meta["step"]), dict(meta["files"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"checkpoint {path}: {MANIFEST} is unreadable ({type(exc).__name__}: {exc})") from None
    for rel, (size, digest) in files.items():
        f = path / rel
        if not f.is_file():
            raise ValueError(f"checkpoint {path}: file {rel} listed in {MANIFEST} is missing")
        if f.stat().st_size != size:
            raise ValueError(f"checkpoint {path}: file {rel} has {f.stat().st_size} bytes, {MANIFEST} says {size} "
                             f"(truncated or replaced)")
        if hashes and _sha256(f) != digest:
            raise ValueError(f"checkpoint {path}: file {rel} does not match its sha256 in {MANIFEST} (corrupted)")
    return Checkpoint(path=path, step=step, config=json.loads((path / "run_config.json").read_text()))


def latest(run_dir: Path, *, hashes: bool) -> Checkpoint | None:
    """The newest committed checkpoint of a run, verified; None when it has none."""
    found = complete_checkpoints(run_dir)
    return open_checkpoint(found[-1], hashes=hashes) if found else None


def config_changes(saved: dict, now: dict) -> list[str]:
    """Dotted keys whose value differs between two resolved configs, except RESUMABLE_CHANGES."""
    def flat(d: dict, prefix: str = "") -> dict:
        out = {}
        for k, v in d.items():
            key = f"{prefix}{k}"
            if isinstance(v, dict) and key not in RESUMABLE_CHANGES:
                out.update(flat(v, key + "."))
            else:
                out[key] = v
        return out

    a, b = flat(saved), flat(now)
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(a.keys() | b.keys())
            if a.get(k) != b.get(k) and k not in RESUMABLE_CHANGES and not _engine_option(k)]


def _engine_option(key: str) -> bool:
    """A key of an engine's own options (generator.<section>.*, every generator key that is not a declared field):
    a resume may change the engine, and its options with it."""
    section, _, rest = key.removeprefix("generator.").partition(".")
    return key.startswith("generator.") and bool(rest) and section not in GeneratorConfig.model_fields
