"""The README and docs/ stay true: the config table states every field of every section with its
default; every link of every page reaches a file and a heading that exist; every command they show
names a make target that exists, flags launch.py takes and config keys the config has; the README
is a front door (at most 300 lines)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import BaseModel

from tidal.executors.critic.config import CriticConfig
from tidal.executors.evaluation.config import EvalConfig
from tidal.executors.generator.config import DataConfig, GeneratorConfig, ModelConfig, MultiTurnConfig
from tidal.executors.generator.vllm_engine import VllmConfig
from tidal.executors.reward.config import RewardConfig, RewardModelConfig
from tidal.executors.trainer.config import TrainerConfig
from tidal.modeling.lora import LoraConfig
from tidal.modeling.loss_scale import LossScaleConfig
from tidal.recipes.config import LoggingConfig, RunConfig

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
TABLE = (ROOT / "docs" / "configuration.md").read_text()
SECTIONS = {"top level": RunConfig, "`model`": ModelConfig, "`data`": DataConfig, "`generator`": GeneratorConfig,
            "`generator.vllm`": VllmConfig, "`reward`": RewardConfig, "`reward.model`": RewardModelConfig,
            "`trainer`": TrainerConfig, "`trainer.lora`": LoraConfig,
            "`trainer.loss_scale`": LossScaleConfig, "`critic`": CriticConfig,
            "`eval`": EvalConfig, "`logging`": LoggingConfig, "`multi_turn`": MultiTurnConfig}
NOT_OPTIONS = {"algo", "algo_config", "sources", "auto"}  # set by --algo and the CLI, not by a config


def _row(section: str) -> str:
    rows = [line for line in TABLE.splitlines() if line.startswith(f"| {section} |")]
    assert len(rows) == 1, f"docs/configuration.md: {len(rows)} rows for {section}"
    return rows[0]


def _renders(value) -> set[str]:
    """How a default may be written: 1e-3 as 0.001 or 1e-3, True as true, (0.9, 0.999) as is, None."""
    out = {str(value), repr(value), str(value).lower()}
    if isinstance(value, float):
        out |= {f"{value:g}", f"{value:.0e}".replace("e-0", "e-").replace("e+0", "e")}
    if isinstance(value, tuple):
        out.add("(" + ", ".join(map(str, value)) + ")")
    return out


@pytest.mark.parametrize("section", sorted(SECTIONS))
def test_config_table_states_every_default(section):
    row, cls = _row(section), SECTIONS[section]
    for name, info in cls.model_fields.items():
        if name in NOT_OPTIONS or (isinstance(info.default, BaseModel) or info.default_factory is not None
                                   and name not in ("betas",)):
            continue  # a sub-section has its own row
        found = re.search(rf"`{name}`[^`(|]{{0,4}}\((.*?)\)(?:,|$| \|)", row)
        assert found, f"docs/configuration.md: {section} row does not list `{name}` with its default in parentheses"
        stated = found.group(1)
        assert any(stated.startswith(r) for r in _renders(info.default)), \
            f"docs/configuration.md: {section}.{name} says ({stated}), the default is {info.default!r}"


def _prose(text: str) -> str:
    """The page without its fenced code blocks (a link or heading there is not one)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def _slug(heading: str) -> str:
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    return {_slug(h) for h in re.findall(r"^#{1,6} (.+)$", _prose(page.read_text()), flags=re.M)}


def _links(page: Path) -> list[str]:
    return [t for t in re.findall(r"\]\(([^)\s]+)\)", _prose(page.read_text())) if "://" not in t]


def test_every_link_reaches_a_file_and_a_heading():
    bad = []
    for page in PAGES:
        for target in _links(page):
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                bad.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and (file.suffix != ".md" or anchor not in _anchors(file)):
                bad.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert bad == []


FOLDERS = ("tidal", "bench", "docs", "examples", "tests", "tests_gpu", "tests_vllm")
# tidal's packages too: a path without its `tidal/` names no file from the root
PACKAGES = ("algorithms", "channels", "common", "controller", "executors", "launch", "modeling", "planner", "recipes")
PATH_RE = re.compile(rf"(?<![\w/.-])(?:{'|'.join(FOLDERS + PACKAGES)})/(?:[a-z_0-9]+/)*[a-z_0-9]+\.(?:py|md)\b")
EXAMPLES_OF_BAD_PATHS = {"tests/test_layers.py"}  # it names made-up files to test the layer check's messages


def test_every_project_path_a_docstring_or_page_names_exists():
    """A module or page that names a file after its rename sends a reader nowhere."""
    sources = [p for folder in FOLDERS for p in (ROOT / folder).rglob("*") if p.suffix in (".py", ".md")]
    bad = [f"{src.relative_to(ROOT)}: {path}" for src in [*sources, ROOT / "README.md", ROOT / "launch.py"]
           if str(src.relative_to(ROOT)) not in EXAMPLES_OF_BAD_PATHS
           for path in sorted(set(PATH_RE.findall(src.read_text()))) if not (ROOT / path).exists()]
    assert bad == []


def test_every_page_is_linked_from_the_readme():
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in _links(ROOT / "README.md")}
    assert [p.name for p in PAGES[1:] if p.resolve() not in linked] == []


def _config_keys() -> set[str]:
    """Every dotted key --set takes (algorithm.* under any algorithm's options)."""
    from tidal.algorithms.registry import ALGORITHMS
    from tidal.executors.generator.engines import options_sections

    def walk(cls, prefix: str) -> set[str]:
        out = set()
        for name, info in cls.model_fields.items():
            out.add(prefix + name)
            kind = info.annotation
            if isinstance(kind, type) and issubclass(kind, BaseModel):
                out |= walk(kind, f"{prefix}{name}.")
            for arg in getattr(kind, "__args__", ()):  # an optional section: SectionConfig | None
                if isinstance(arg, type) and issubclass(arg, BaseModel):
                    out |= walk(arg, f"{prefix}{name}.")
        return out

    keys = walk(RunConfig, "")
    for section, options in options_sections("native").items():  # every registered engine's own section
        keys |= {f"generator.{section}"} | walk(options, f"generator.{section}.")
    for name in ALGORITHMS.names():
        keys |= walk(ALGORITHMS.get(name).config_cls, "algorithm.")
    return keys


def _commands() -> list[tuple[str, str]]:
    """(page, command) for every `make ...`, `python launch.py ...` or `torchrun ... launch.py ...` a page
    shows, in a code block (its lines joined across backslashes) or inline."""
    out = []
    for page in PAGES:
        text = page.read_text()
        blocks = re.findall(r"^```(?:bash|sh)?\n(.*?)^```", text, flags=re.S | re.M)
        lines = [line for block in blocks for line in block.replace("\\\n", " ").splitlines()]
        lines += re.findall(r"`([^`\n]+)`", _prose(text))
        for line in lines:
            line = line.split(" #")[0].strip().lstrip("$ ")
            if re.match(r"(make |python3? launch\.py|torchrun .*launch\.py|\.venv\S*/bin/python launch\.py)", line):
                out.append((page.relative_to(ROOT).as_posix(), line))
    return out


def test_commands_name_real_targets_flags_and_keys():
    from tidal.launch.cli import parser

    targets = set(re.findall(r"^([\w-]+):", (ROOT / "Makefile").read_text(), flags=re.M))
    flags = set(parser()._option_string_actions)
    keys = _config_keys()
    commands, bad = _commands(), []
    assert len(commands) > 20, commands  # the pages do show commands: the parsing found them
    for page, line in commands:
        words = line.split()
        if words[0] == "make":
            bad += [f"{page}: {line} (no make target {w})" for w in words[1:] if "=" not in w and w not in targets]
            continue
        after = words[next(i for i, w in enumerate(words) if w.endswith("launch.py")) + 1:]
        for i, w in enumerate(after):
            flag = w.split("=")[0]
            if flag.startswith("--") and flag not in flags:
                bad.append(f"{page}: {line} (launch.py has no {flag})")
            if flag == "--set" and i + 1 < len(after) and "=" in after[i + 1]:
                key = after[i + 1].strip("'\"").split("=")[0]
                if key not in keys and not key.startswith("<"):
                    bad.append(f"{page}: {line} (no config key {key})")
    assert bad == []


def test_the_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300, len(lines)
    text = "\n".join(lines)
    assert "make demo" in text and "make test" in text and "docs/architecture.md" in text
