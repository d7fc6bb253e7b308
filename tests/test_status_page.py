"""docs/status.md says what is true of the config. Its table "Refused before any rank starts" lists every refusal
the page names as settings and words of the message: each row is resolved as `launch.py` resolves its flags and its
graph is built (the recipe's checks), and must be refused with those words; a refusal lifted, or a row refused for
another reason, fails here. What the page says is built (fp16, exact numerics, pipeline parallel, LoRA, expert
parallel) is what the engines' and backends' registries declare, and fp16 is accepted."""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from tidal.channels.kinds import Kind
from tidal.controller.job import with_schedule
from tidal.controller.schedules import get_schedule
from tidal.executors.generator.engines import ENGINES
from tidal.executors.trainer.backends import BACKENDS
from tidal.launch.cli import parser, resolve
from tidal.recipes.registry import recipe_for

PAGE = (Path(__file__).resolve().parents[1] / "docs" / "status.md").read_text()
PROSE = re.sub(r"\s+", " ", PAGE)
HEADING = "## Refused before any rank starts"


def _table() -> list[tuple[str, str]]:
    """(settings, words of the message) of each row: the settings cell's code spans, joined."""
    assert HEADING in PAGE, f"docs/status.md has no section {HEADING!r}"
    section = PAGE.split(HEADING, 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) != 2 or not line.startswith("|") or cells[0] in ("settings", "---"):
            continue
        rows.append((" ".join(re.findall(r"`([^`]+)`", cells[0])), cells[1].replace("`", "")))
    return rows


ROWS = _table()


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, str]:
    """The directories the table's <placeholders> name, their config.json alone: all the checks read (the tiny
    MoE's is tidal/modeling/tiny/moe.py's, without its weights)."""
    import transformers

    from tidal.modeling.tiny.moe import MODEL_SIZES, MOE_SIZES

    root, out = tmp_path_factory.mktemp("models"), {}
    for name, config in {"<tiny-moe>": transformers.Qwen3MoeConfig(**MODEL_SIZES, **MOE_SIZES),
                         "<mistral>": transformers.MistralConfig(),  # slides every layer (sliding_window)
                         "<gemma-2>": transformers.Gemma2Config(num_hidden_layers=2,
                                                                layer_types=["full_attention"] * 2)}.items():
        config.save_pretrained(root / name.strip("<>"))
        out[name] = str(root / name.strip("<>"))
    return out


def _launch_args(settings: str, models: dict[str, str]) -> list[str]:
    """`key=value` -> --set key=value; `--flag value` as it is; --algo grpo unless the row names one."""
    words, args = settings.split(), []
    while words:
        word = words.pop(0)
        if word.startswith("--"):
            args += [word, words.pop(0)]
            continue
        key, sep, value = word.partition("=")
        assert sep, f"docs/status.md: {word!r} in {settings!r} is neither key=value nor a flag"
        if value.startswith("<"):
            assert value in models, f"docs/status.md: no model for {value!r} (known: {sorted(models)})"
        args += ["--set", f"{key}={models.get(value, value)}"]
    return args if "--algo" in args else ["--algo", "grpo", *args]


def _launch_checks(args: list[str]):
    """What `python launch.py ARGS` checks before it starts a rank: the resolved config, then the graph."""
    cfg = resolve(parser().parse_args(args))
    return recipe_for(cfg.algo).build(cfg)


def test_the_table_is_found():
    assert len(ROWS) >= 15, ROWS  # the parsing found the rows


@pytest.mark.parametrize("settings, words", ROWS, ids=[s for s, _ in ROWS])
def test_a_refusal_the_status_page_lists_is_raised(settings, words, models, monkeypatch):
    # as where vLLM is installed: without it the vLLM engine's own check ("not installed") would speak first
    monkeypatch.setattr("tidal.executors.generator.vllm_engine.vllm_available", lambda: True)
    args = _launch_args(settings, models)
    with pytest.raises(ValueError) as refused:
        _launch_checks(args)
    message = re.sub(r"\s+", " ", str(refused.value))
    assert words in message, f"docs/status.md: {settings!r} is refused, but not with {words!r}: {message}"


def test_a_weights_lag_outside_the_offpolicy_schedule_is_refused():
    assert "A WEIGHTS channel with a lag of 2 or more outside this schedule is refused" in PROSE
    graph = _launch_checks(["--algo", "grpo"])
    lagged = [dataclasses.replace(ch, lag=2) if ch.kind is Kind.WEIGHTS else ch for ch in graph.channels]
    assert lagged != graph.channels
    with pytest.raises(ValueError, match="WEIGHTS lag 2, but the periodic schedule"):
        with_schedule(dataclasses.replace(graph, channels=lagged), get_schedule("periodic"))
    with_schedule(dataclasses.replace(graph, channels=lagged), get_schedule("offpolicy", max_lag=1))


# (words of the page, the registry, the capability, the entries the page says have it)
BUILT = [
    ("built for the torch backend only (megatron, LoRA and the critic refuse it)", BACKENDS, "fp16", {"torch"}),
    ("`model.numerics=exact`, [Numerics](numerics.md)): CPU only, native engine and torch backend",
     ENGINES, "exact", {"native"}),
    ("`model.numerics=exact`, [Numerics](numerics.md)): CPU only, native engine and torch backend",
     BACKENDS, "exact", {"torch"}),
    ("Pipeline parallel (`trainer.pp`, megatron backend", BACKENDS, "pipeline", {"megatron"}),
    ("Mixture of experts and LoRA ([big-models.md](big-models.md)): with the native engine and the torch backend",
     BACKENDS, "lora", {"torch"}),
    ("Mixture of experts and LoRA ([big-models.md](big-models.md)): with the native engine and the torch backend",
     BACKENDS, "expert_parallel", {"torch"}),
]


@pytest.mark.parametrize("words, registry, capability, names", BUILT, ids=[f"{c} {sorted(n)}" for *_, c, n in BUILT])
def test_what_the_status_page_says_is_built_is_declared(words, registry, capability, names):
    assert words in PROSE, f"docs/status.md no longer says {words!r}"
    declared = {name for name in registry.names() if getattr(registry.get(name), capability)}
    assert declared == names, f"docs/status.md: {capability} is built for {sorted(names)}, the registry declares " \
                              f"{sorted(declared)}"


def test_fp16_is_accepted_where_the_page_says_it_is_built():
    _launch_checks(["--algo", "grpo", "--set", "trainer.precision=fp16"])
