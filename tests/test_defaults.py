"""Defaults by what is loaded (the embedded task vs a pretrained model.path), and config.json's record
of where each value came from."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

from tidal.modeling.hf import load_model, load_tokenizer, save_hf
from tidal.launch.cli import parser, resolve
from tidal.recipes.config import non_defaults
from tidal.recipes.defaults import PRETRAINED, decode_slots, flatten, sources

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
    assert set(cfg.sources.values()) == {"default", "--algo", "auto"}  # auto: the launch's choice (tidal/launch/auto.py)
    assert {k for k, _, _ in non_defaults(cfg)} == {"algo", "placement", "schedule.kind"}


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


def test_decode_slots_come_from_the_step_shape_unless_set(model_dir):
    """Where no rates were measured (a library call; a rank under torchrun without a cache entry), a
    pretrained model's slots make waves of a replica's prompts by the rule (so periodic overlaps even when
    every sample reaches the cap: tests/test_overlap_default.py); what the user sets wins. The launch's
    measured choice: tests/test_auto.py."""
    cfg = _resolve("--set", f"model.path={model_dir}")  # B=8, G=16 on this CPU: one group (16 rows) a wave
    assert cfg.generator.max_batch_prompts == 1 and cfg.sources["generator.max_batch_prompts"] == "auto"
    cfg = _resolve("--set", f"model.path={model_dir}", "--set", "data.prompts_per_step=16",
                   "--set", "generator.samples_per_prompt=4", "--set", "generator.replicas=2")
    assert cfg.generator.max_batch_prompts == 4  # 16 rows a wave, 8 prompts per replica: 2 waves
    cfg = _resolve("--set", f"model.path={model_dir}", "--set", "data.prompts_per_step=4",
                   "--set", "generator.samples_per_prompt=4")
    assert cfg.generator.max_batch_prompts == 2  # 4 prompts: at least 2 waves on CPU
    for no_overlap in (["--schedule", "sync"], ["--set", "placement=colocated"]):  # training never runs beside
        cfg = _resolve("--set", f"model.path={model_dir}", "--set", "data.prompts_per_step=4",
                       "--set", "generator.samples_per_prompt=4", *no_overlap)
        assert cfg.generator.max_batch_prompts == 4, no_overlap  # generation: one wave, waves would only cost
    cfg = _resolve("--set", f"model.path={model_dir}", "--set", "generator.max_batch_prompts=16")
    assert cfg.generator.max_batch_prompts == 16 and cfg.sources["generator.max_batch_prompts"] == "--set"
    # vLLM: the same waves as a cap on the sample rows in flight; the native slots keep their default
    cfg = _resolve("--set", f"model.path={model_dir}", "--set", "generator.engine=vllm")
    assert cfg.generator.vllm.max_num_seqs == 16 and cfg.sources["generator.vllm.max_num_seqs"] == "auto"
    assert cfg.sources["generator.max_batch_prompts"] == "default"
    cfg = _resolve("--set", f"model.path={model_dir}", "--set", "generator.engine=vllm",
                   "--set", "generator.vllm.max_num_seqs=64")
    assert cfg.generator.vllm.max_num_seqs == 64 and cfg.sources["generator.vllm.max_num_seqs"] == "--set"
    assert _resolve().generator.max_batch_prompts == 2  # the embedded job keeps its tuned 2


def test_decode_slots_on_an_accelerator_fill_a_wave_of_256_rows():
    """Rows are nearly free there up to a few hundred: one wave unless the step has more rows."""
    assert decode_slots(prompts=8, samples=16, replicas=1, device_type="cuda") == 8  # 128 rows, one wave
    assert decode_slots(prompts=64, samples=16, replicas=1, device_type="npu") == 16  # 4 waves of 256 rows
    assert decode_slots(prompts=64, samples=16, replicas=4, device_type="cuda") == 16  # 16 a replica: one wave
    assert decode_slots(prompts=4, samples=512, replicas=1, device_type="cuda") == 1
    assert decode_slots(prompts=1, samples=4, replicas=1, device_type="cpu") == 1


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
    """A run's config.json (values and their _sources, as tidal/launch/run.py writes it) is a valid --config
    and gives the same run."""
    cfg = _resolve("--set", f"model.path={model_dir}", "--set", "trainer.lr=3e-6")
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**cfg.resolved(), "_sources": cfg.sources}))
    again = _resolve("--config", str(path))
    assert again.resolved() == cfg.resolved()
    assert again.sources["trainer.lr"] == f"file {path}"


def test_a_sliding_window_model_packs_by_default(model_dir, tmp_path):
    """Packed rows take a sliding window (tidal/modeling/packed_attention.py): a model whose layers but the last
    slide over 4 positions keeps shared_prompt=auto, and its trainer recomputes, from packed rows, the
    log-probs the generator sampled with (a row without the window would differ: prompts and responses
    run past 4 positions)."""
    from tests.e2e import launch, metrics

    slides = tmp_path / "sliding"
    slides.mkdir()
    for f in model_dir.iterdir():
        if f.is_file():
            (slides / f.name).write_bytes(f.read_bytes())
    config = json.loads((model_dir / "config.json").read_text())
    layers = config["num_hidden_layers"]
    config.update(use_sliding_window=True, sliding_window=4,  # Qwen3 drops a window that is not switched on
                  layer_types=["sliding_attention"] * (layers - 1) + ["full_attention"])
    (slides / "config.json").write_text(json.dumps(config))
    proc = launch(tmp_path / "run", "--set", f"model.path={slides}", "--set", "generator.max_new_tokens=12",
                  steps=2, defaults=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = json.loads((tmp_path / "run" / "config.json").read_text())
    assert run["trainer"]["shared_prompt"] == "auto" and run["_sources"]["trainer.shared_prompt"] == "default"
    rows = metrics(tmp_path / "run")
    assert all(r["trainer/response_len_mean"] > 4 and r["trainer/logp_mismatch_max"] < 1e-4 for r in rows), rows
