"""Defaults by what is loaded (the embedded task vs a pretrained model.path), and config.json's record
of where each value came from."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from executors.hf import load_model, load_tokenizer, save_hf
from launch.cli import parser, resolve
from recipes.config import non_defaults
from recipes.defaults import PRETRAINED, flatten, sources

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("model")
    save_hf(load_model(None), load_tokenizer(None), out)
    return out


def _resolve(*argv: str):
    return resolve(parser().parse_args(["--algo", "grpo", *argv]))


def test_embedded_task_keeps_its_tuned_defaults():
    cfg = _resolve()
    assert cfg.trainer.lr == 1e-3 and cfg.trainer.warmup_steps == 0 and cfg.generator.max_new_tokens == 8
    assert set(cfg.sources.values()) == {"default", "--algo"}
    assert [k for k, _, _ in non_defaults(cfg)] == ["algo"]


def test_pretrained_model_gets_fine_tuning_defaults(model_dir):
    cfg = _resolve("--set", f"model.path={model_dir}")
    assert (cfg.trainer.lr, cfg.trainer.warmup_steps) == (1e-6, 10)
    assert (cfg.generator.max_new_tokens, cfg.data.max_prompt_tokens) == (256, 512)
    assert cfg.trainer.grad_clip == 1.0 and cfg.algo_config.beta == 0.0  # clipped, no KL: as the embedded task
    assert not cfg.data.chat_template  # the embedded tokenizer has no chat template
    for key in PRETRAINED:
        assert cfg.sources[key] == "pretrained default", key
    assert cfg.sources["model.path"] == "--set" and cfg.sources["trainer.betas"] == "default"


def test_what_the_user_sets_wins_and_is_named(model_dir, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(f"model: {{path: {model_dir}}}\ntrainer: {{warmup_steps: 3, betas: [0.9, 0.95]}}\n")
    cfg = _resolve("--config", str(config), "--set", "trainer.lr=2e-6", "--steps", "7")
    assert (cfg.trainer.lr, cfg.trainer.warmup_steps, cfg.steps) == (2e-6, 3, 7)
    assert cfg.sources["trainer.lr"] == "--set" and cfg.sources["steps"] == "--steps"
    assert cfg.sources["trainer.warmup_steps"] == cfg.sources["trainer.betas"] == f"file {config}"
    assert cfg.sources["generator.max_new_tokens"] == "pretrained default"
    # --set over the file: the later layer names the value
    cfg = _resolve("--config", str(config), "--set", "trainer.warmup_steps=0")
    assert cfg.trainer.warmup_steps == 0 and cfg.sources["trainer.warmup_steps"] == "--set"


def test_chat_template_on_for_a_tokenizer_that_has_one(model_dir, tmp_path):
    chat = tmp_path / "chat"
    chat.mkdir()
    for f in model_dir.iterdir():
        (chat / f.name).write_bytes(f.read_bytes())
    tok_cfg = json.loads((chat / "tokenizer_config.json").read_text())
    tok_cfg["chat_template"] = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    (chat / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    cfg = _resolve("--set", f"model.path={chat}")
    assert cfg.data.chat_template and cfg.sources["data.chat_template"] == "pretrained default"
    assert not _resolve("--set", f"model.path={chat}", "--set", "data.chat_template=false").data.chat_template


def test_preset_is_named_as_a_preset(tmp_path):
    cfg = _resolve("--config", str(ROOT / "configs" / "qwen2.5-7b-8xh100.yaml"), "--set", f"model.path={tmp_path}")
    assert cfg.sources["trainer.precision"].startswith("preset ") and cfg.sources["model.path"] == "--set"


def test_sources_of_nested_and_whole_sections():
    resolved = {"a": 1, "s": {"x": 1, "y": [1, 2]}, "t": {"u": 2}}
    got = sources(resolved, [("file f", {"s": {"y": [3]}, "t": {}}), ("--set", {"a": 5})])
    assert got == {"a": "--set", "s.x": "default", "s.y": "file f", "t.u": "default"}
    assert flatten({"s": {"x": {"z": 1}}, "e": {}}) == {"s.x.z": 1}


def test_config_json_passes_back_as_a_config(model_dir, tmp_path):
    """A run's config.json (values and their _sources, as launch/run.py writes it) is a valid --config
    and gives the same run."""
    cfg = _resolve("--set", f"model.path={model_dir}", "--set", "trainer.lr=3e-6")
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**cfg.resolved(), "_sources": cfg.sources}))
    again = _resolve("--config", str(path))
    assert again.resolved() == cfg.resolved()
    assert again.sources["trainer.lr"] == f"file {path}"
