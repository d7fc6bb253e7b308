"""The README's config table states every field of every section, with its default."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
from pydantic import BaseModel

from executors.critic.config import CriticConfig
from executors.evaluation.config import EvalConfig
from executors.generator.config import DataConfig, GeneratorConfig, ModelConfig, MultiTurnConfig, VllmConfig
from modeling.lora import LoraConfig
from executors.reward.config import RewardConfig, RewardModelConfig
from executors.trainer.config import TrainerConfig
from recipes.config import LoggingConfig, RunConfig

README = (Path(__file__).resolve().parents[1] / "README.md").read_text()
SECTIONS = {"top level": RunConfig, "`model`": ModelConfig, "`data`": DataConfig, "`generator`": GeneratorConfig,
            "`generator.vllm`": VllmConfig, "`reward`": RewardConfig, "`reward.model`": RewardModelConfig, "`trainer`": TrainerConfig, "`trainer.lora`": LoraConfig, "`critic`": CriticConfig,
            "`eval`": EvalConfig, "`logging`": LoggingConfig, "`multi_turn`": MultiTurnConfig}
NOT_OPTIONS = {"algo", "algo_config", "sources"}  # set by --algo and the CLI, not by a config


def _row(section: str) -> str:
    rows = [line for line in README.splitlines() if line.startswith(f"| {section} |")]
    assert len(rows) == 1, f"README config table: {len(rows)} rows for {section}"
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
        assert found, f"README: {section} row does not list `{name}` with its default in parentheses"
        stated = found.group(1)
        assert any(stated.startswith(r) for r in _renders(info.default)), \
            f"README: {section}.{name} says ({stated}), the default is {info.default!r}"
