"""The CLI surface (frozen), config errors (one line naming the field, exit 2) and --dry-run."""
from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tidal.launch.cli import parser

ROOT = Path(__file__).resolve().parents[1]


def _launch(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "launch.py", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)


def test_cli_surface_is_frozen():
    flags = sorted(opt for action in parser()._actions for opt in action.option_strings)
    assert flags == ["--algo", "--config", "--devices", "--dry-run", "--help", "--max-restarts", "--output-dir",
                     "--overwrite", "--plan", "--rates", "--resume", "--schedule", "--seed", "--set", "--steps", "-h"]


def test_dry_run_prints_placement_and_channels():
    proc = _launch("--algo", "grpo", "--dry-run", "--set", "trainer.dp=2", "--set", "generator.replicas=2")
    assert proc.returncode == 0, proc.stderr
    out, memory = proc.stdout.split("memory per rank")
    assert "world size 5" in out
    lines = {line.split()[0]: line for line in out.splitlines() if line.split()}
    # the memory estimate (tidal/launch/memory.py), per executor
    assert "0.9M parameters" in memory and "trainer     weights 3 MB, AdamW state 7 MB" in memory
    assert lines["generator"].split()[2:4] == ["0-1", "0"] and "1" in lines["generator"].split()[4]
    assert lines["reward"].split()[2] == "2"
    assert lines["trainer"].split()[2] == "3-4" and "dp=2" in lines["trainer"]
    assert "generator.rollouts -> reward.rollouts" in out and "scatter" in lines["rollouts"]
    assert "trainer.weights -> generator.weights" in out and "next step" in lines["weights"]


def test_dry_run_places_tensor_parallel_units():
    proc = _launch("--algo", "grpo", "--dry-run", "--set", "trainer.dp=2", "--set", "trainer.tp=2",
                   "--set", "trainer.fsdp=true", "--set", "generator.tp=2")
    assert proc.returncode == 0, proc.stderr
    assert "world size 7" in proc.stdout
    lines = {line.split()[0]: line.split() for line in proc.stdout.split("memory per rank")[0].splitlines()
             if line.split()}
    assert lines["generator"][2:4] == ["0-1", "0-1"]  # one replica of 2 tp ranks
    assert lines["trainer"][2:5] == ["3-6", "3-4", "5-6"]  # dp units of 2 tp ranks each
    assert "fsdp=True" in " ".join(lines["trainer"])


@pytest.mark.parametrize("args,message", [
    (["--set", "trainer.lr=abc"], "invalid config (command line): trainer.lr: Input should be a valid number"),
    (["--set", "trainer.lrr=1"], "trainer.lrr: unknown key; did you mean trainer.lr?"),
    (["--set", "trainr.lr=1"], "trainr: unknown key; did you mean trainer?"),
    (["--set", "algorithm.clip_lo=0.1"], "algorithm.clip_lo: unknown key; did you mean algorithm.clip_low?"),
    (["--set", "algorithm.clip_low=2"], "algorithm.clip_low: Input should be less than 1"),
    (["--set", "algorithm.nope=1"], "algorithm.nope: unknown key\n"),  # nothing close: no guess
    (["--set", "novalue"], "--set 'novalue': expected KEY=VALUE"),
    (["--steps", "0"], "steps: Input should be greater than or equal to 1 (got 0)"),
    (["--set", "trainer.mini_batches=20"], "trainer.mini_batches (20) x trainer.dp (1) exceeds data.prompts_per_step"),
    (["--set", "trainer.tp=3"], "trainer.tp=3 does not fit the model: tp=3 must divide num_attention_heads=4, "
                                "num_key_value_heads=2, vocab_size=512"),
    (["--set", "generator.tp=4"], "generator.tp=4 does not fit the model: tp=4 must divide num_key_value_heads=2"),
    (["--set", "trainer.tp=0"], "trainer.tp: Input should be greater than or equal to 1"),
    (["--set", "generator.engine=vllm", "--set", "generator.top_p=0.9"], "generator.engine=vllm needs generator.top_p=1"),
    (["--set", "generator.engine=fast"], "generator.engine: unknown generator engine 'fast'; known: native, vllm"),
    (["--set", "trainer.backend=jax"], "trainer.backend: unknown trainer backend 'jax'; known: megatron, torch"),
    (["--set", "generator.engine=tests.nosuch:ENGINE"], "generator.engine: generator engine 'tests.nosuch:ENGINE': "
                                                        "cannot import module 'tests.nosuch'"),
    (["--set", "trainer.pp=2"], "trainer.pp=2: trainer.backend=torch has no pipeline parallel; use "
                                "trainer.backend=megatron"),
])
def test_config_errors_name_the_field(args, message):
    proc = _launch("--algo", "grpo", "--dry-run", *args)
    assert proc.returncode == 2
    assert message in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr


def test_help_lists_the_registered_algorithms(monkeypatch):
    from tidal.algorithms.registry import ALGORITHMS

    help_text = " ".join(parser().format_help().split())
    assert "--algo NAME algorithm: dapo, dr_grpo, grpo, gspo, ppo, reinforce_pp, rloo" in help_text
    monkeypatch.setitem(ALGORITHMS._entries, "my_algo", ALGORITHMS.get("grpo"))  # a newly registered one shows too
    assert "gspo, my_algo, ppo" in " ".join(parser().format_help().split())


def test_unknown_algo_lists_known():
    proc = _launch("--algo", "ppo9000", "--dry-run")
    known = "dapo, dr_grpo, grpo, gspo, ppo, reinforce_pp, rloo"
    assert proc.returncode == 2 and f"unknown algo 'ppo9000'; known: {known}" in proc.stderr


def test_config_file_errors_name_the_file(tmp_path):
    bad = tmp_path / "run.yaml"
    bad.write_text("trainer:\n  dp: two\n")
    proc = _launch("--algo", "grpo", "--dry-run", "--config", str(bad))
    assert proc.returncode == 2 and f"invalid config ({bad}): trainer.dp" in proc.stderr
    good = tmp_path / "run.json"
    good.write_text(json.dumps({"trainer": {"dp": 3}, "steps": 2}))
    proc = _launch("--algo", "grpo", "--dry-run", "--config", str(good))
    assert proc.returncode == 0 and "world size 5" in proc.stdout
    proc = _launch("--algo", "grpo", "--dry-run", "--config", str(tmp_path / "missing.yaml"))
    assert proc.returncode == 2 and "missing.yaml does not exist" in proc.stderr


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_vllm_engine_without_vllm_says_how_to_get_it():
    proc = _launch("--algo", "grpo", "--dry-run", "--set", "generator.engine=vllm")
    assert proc.returncode == 2
    assert "generator.engine=vllm: vLLM is not installed in this environment (CPU: `make install-vllm`" in proc.stderr


def test_pipeline_refuses_what_its_schedule_does_not_carry():
    """trainer.pp's refusals beside the CLI's (the torch backend, above): in-process, no job."""
    from tidal.recipes.checks import check_pipeline, check_trainer
    from tidal.recipes.config import RunConfig

    cfg = RunConfig.model_validate({"algo": "reinforce_pp", "trainer": {"backend": "megatron", "pp": 2}})
    with pytest.raises(ValueError, match="trainer.pp=2 with algorithm 'reinforce_pp': batch-scope advantages"):
        check_pipeline(cfg, batch_scope=True)
    check_pipeline(cfg, batch_scope=False)  # group scope: runs
    uneven = RunConfig.model_validate({"trainer": {"backend": "megatron", "pp": 3}})
    with pytest.raises(ValueError, match="trainer.pp=3 must divide the model's 4 decoder layers"):
        check_trainer(uneven, dynamic_sampling=False)


def test_fsdp_refuses_dynamic_sampling():
    proc = _launch("--algo", "dapo", "--dry-run", "--set", "trainer.fsdp=true", "--set", "trainer.dp=2",
                   "--set", "algorithm.dynamic_sampling=true")
    assert proc.returncode == 2
    assert "algorithm.dynamic_sampling with trainer.fsdp and trainer.dp > 1 is not supported" in proc.stderr


@pytest.mark.parametrize("config, message", [
    ("MistralConfig", "trainer.backend=megatron converts qwen3, qwen2, llama models; this one is 'mistral'"),
    ("LlamaConfig", "trainer.backend=megatron: rope scaling 'linear' is not supported yet"),
])
def test_megatron_backend_refuses_a_model_it_cannot_convert_before_any_rank_starts(tmp_path, config, message):
    import transformers

    sizes = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                 num_key_value_heads=2)
    extra = {"rope_scaling": {"rope_type": "linear", "factor": 2.0}} if config == "LlamaConfig" else {}
    getattr(transformers, config)(**sizes, **extra).save_pretrained(tmp_path)  # config.json is all the check reads
    proc = _launch("--algo", "grpo", "--dry-run", "--set", f"model.path={tmp_path}", "--set", "trainer.backend=megatron")
    assert proc.returncode == 2
    assert proc.stderr.strip() == f"error: {message}"


def test_a_config_error_under_torchrun_is_said_once_by_rank_0(monkeypatch, capsys):
    """Every rank checks the same config: rank 0 says the error at once; another rank waits for the launcher to
    stop it (so it cannot end the job before rank 0 has printed) and says it, with its rank, only if still running."""
    import tidal.launch.cli as cli

    waited = []
    monkeypatch.setattr(cli.time, "sleep", waited.append)
    for rank in ("0", "2"):
        monkeypatch.setenv("RANK", rank)
        assert cli.main(["--algo", "grpo", "--set", "trainer.dp=two"]) == 2
    err = capsys.readouterr().err.splitlines()
    message = "invalid config (command line): trainer.dp: Input should be a valid integer"
    assert err[0].startswith(f"error: {message}") and err[1].startswith(f"error (rank 2): {message}")
    assert waited == [cli.RANK_ERROR_WAIT_S] and len(err) == 2
