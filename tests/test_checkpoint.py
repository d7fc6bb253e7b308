"""Checkpoint directories: sealed by a manifest written last, verified on open, pruned to the newest K;
the config keys a resumed run may change."""
from __future__ import annotations

import os
import stat

import pytest

from tidal.controller.checkpoint import (commit, complete_checkpoints, config_changes, latest, open_checkpoint,
                                   step_dir, tmp_dir)

CONFIG = {"seed": 0, "steps": 10, "trainer": {"lr": 1e-3, "dp": 1}, "generator": {"vllm": {"kv_cache_gb": None}}}


def _save(run, step: int, payload: bytes = b"weights") -> None:
    tmp = tmp_dir(run, step)
    (tmp / "trainer").mkdir(parents=True)
    (tmp / "model.safetensors").write_bytes(payload)
    os.chmod(tmp / "model.safetensors", 0o600)  # as safetensors writes it
    (tmp / "trainer" / "__0_0.distcp").write_bytes(b"optimizer")
    commit(run, step, config=CONFIG, keep=2)


def test_commit_seals_verifies_and_prunes(tmp_path):
    for step in (1, 3, 5):
        _save(tmp_path, step)
    assert [p.name for p in complete_checkpoints(tmp_path)] == ["step_000003", "step_000005"]  # keep=2
    assert not tmp_dir(tmp_path, 5).exists()
    found = latest(tmp_path, hashes=True)
    assert found.step == 5 and found.config == CONFIG and found.path == step_dir(tmp_path, 5)
    mode = stat.S_IMODE((found.path / "model.safetensors").stat().st_mode)
    umask = os.umask(0)
    os.umask(umask)
    assert mode == 0o666 & ~umask  # readable as the umask says, not 0600


def test_a_damaged_checkpoint_is_refused_naming_the_file(tmp_path):
    _save(tmp_path, 1)
    path = step_dir(tmp_path, 1)
    (path / "model.safetensors").write_bytes(b"weightz")  # same size, other bytes
    open_checkpoint(path, hashes=False)  # sizes agree
    with pytest.raises(ValueError, match="file model.safetensors does not match its sha256"):
        open_checkpoint(path, hashes=True)
    (path / "trainer" / "__0_0.distcp").write_bytes(b"opt")
    with pytest.raises(ValueError, match=r"file trainer/__0_0.distcp has 3 bytes, manifest.json says 9"):
        open_checkpoint(path, hashes=False)
    (path / "trainer" / "__0_0.distcp").unlink()
    with pytest.raises(ValueError, match="file trainer/__0_0.distcp listed in manifest.json is missing"):
        open_checkpoint(path, hashes=False)
    (path / "manifest.json").write_text("{not json")
    with pytest.raises(ValueError, match="manifest.json is unreadable"):
        open_checkpoint(path, hashes=False)


def test_an_unsealed_directory_is_never_a_checkpoint(tmp_path):
    tmp = tmp_dir(tmp_path, 7)
    tmp.mkdir(parents=True)
    (tmp / "model.safetensors").write_bytes(b"half")
    assert latest(tmp_path, hashes=True) is None  # a crash mid-write leaves nothing resumable
    with pytest.raises(ValueError, match="no manifest.json"):
        open_checkpoint(tmp, hashes=False)


def test_config_changes_allow_layout_not_training():
    now = {**CONFIG, "steps": 20, "trainer": {"lr": 1e-3, "dp": 2},
           "generator": {"vllm": {"kv_cache_gb": 4}}}
    assert config_changes(CONFIG, now) == []
    now["trainer"]["lr"] = 1e-4
    now["seed"] = 1
    assert config_changes(CONFIG, now) == ["seed: 0 -> 1", "trainer.lr: 0.001 -> 0.0001"]
