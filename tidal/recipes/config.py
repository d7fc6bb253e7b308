"""The run config: pydantic models with defaults, unknown keys refused, errors naming the field.

Each executor owns its config class (in a light module: parsing a config imports no model code);
this module only composes them. A recipe hands each executor its own section, never the whole
RunConfig.
"""
from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from tidal.algorithms.base import AlgoConfig
from tidal.algorithms.registry import get_algorithm
from tidal.common.config_errors import config_error
from tidal.controller.schedules import ScheduleConfig
from tidal.executors.critic.config import CriticConfig
from tidal.executors.evaluation.config import EvalConfig
from tidal.executors.generator.config import DataConfig, GeneratorConfig, ModelConfig, MultiTurnConfig
from tidal.executors.generator.rollouts import ROLLOUTS
from tidal.executors.reward.config import RewardConfig
from tidal.executors.trainer.config import TrainerConfig

class LoggingConfig(BaseModel):
    """What a run writes besides metrics.jsonl (docs/running.md, Outputs of a run)."""

    model_config = ConfigDict(extra="forbid")
    samples_every: int = Field(1, ge=0, description="samples.jsonl: every sample of every N-th step (prompt, "
                               "response, rewards, advantage, length); 0: never")
    tensorboard: bool = Field(False, description="also write TensorBoard event files to <output_dir>/tensorboard")
    wandb: bool = Field(False, description="also log to Weights & Biases (pip install 'tidal[wandb]'): the config, "
                        "every metric, the plots and the samples table; offline in <output_dir>/wandb without "
                        "credentials (docs/running.md)")
    wandb_project: str = Field("tidal", description="the W&B project")
    wandb_name: str | None = Field(None, description="the W&B run's name; default the output dir's name")
    wandb_mode: Literal["auto", "online", "offline"] = Field(
        "auto", description="auto: online with W&B credentials (WANDB_API_KEY or `wandb login`), else offline; "
        "WANDB_MODE overrides auto")
    plots: bool = Field(True, description="draw timeline.png and metrics.png at the end of the run (about 1.5 s on "
                        "CPU; off for short or scripted runs: timeline.jsonl and metrics.jsonl are written either way)")
    progress_every_s: float = Field(30.0, gt=0, description="while a step runs (or the job starts), a console line "
                                    "says what each executor is doing after this many quiet seconds")

class RunConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")
    seed: int = 0
    steps: int = Field(200, ge=1, description="optimizer steps")
    schedule: ScheduleConfig = ScheduleConfig()
    output_dir: str | None = Field(None, description="default runs/<timestamp>")
    checkpoint_every: int = Field(0, ge=0, description="save checkpoints/step_N every N steps; 0 = by time only")
    checkpoint_minutes: float = Field(30.0, ge=0, description="also save one when this many minutes passed "
                                      "since the last; 0 = never by time")
    checkpoint_keep: int = Field(2, ge=0, description="keep the newest K complete checkpoints; 0 = all")
    timeout_s: float = Field(1800.0, gt=0, description="collective / channel timeout")
    stop_timeout_s: int = Field(300, ge=1, description="python launch.py: how long a stop (SIGTERM, Ctrl-C) may "
                                "take, checkpoint included, before the launcher kills the ranks (torchrun's "
                                "--shutdown-timeout; under torchrun pass that flag)")
    placement: Literal["split", "colocated"] = Field(
        "split", description="split: every executor on ranks of its own, running side by side; colocated: "
        "the generator, reward and trainer (and critic) share every rank, taking turns on its device "
        "(schedule sync only; tidal/controller/colocate.py)")
    rollout: str = Field("single_turn", description="single_turn: one completion per sample; multi_turn: turns "
                         "with an environment between them (the multi_turn section); tidal/executors/generator/rollouts.py")
    multi_turn: MultiTurnConfig = MultiTurnConfig()
    model: ModelConfig = ModelConfig()
    data: DataConfig = DataConfig()
    generator: GeneratorConfig = GeneratorConfig()
    reward: RewardConfig = RewardConfig()
    trainer: TrainerConfig = TrainerConfig()
    critic: CriticConfig = CriticConfig()  # --algo ppo's value model; other algorithms have none
    eval: EvalConfig = EvalConfig()
    logging: LoggingConfig = LoggingConfig()
    algorithm: dict = Field(default_factory=dict, description="options of --algo's config class")

    algo: str = Field("", exclude=True)
    algo_config: AlgoConfig | None = Field(None, exclude=True)
    sources: dict[str, str] = Field(default_factory=dict, exclude=True,
                                    description="where each dotted key's value came from (tidal/launch/cli.py)")
    auto: Any = Field(None, exclude=True, description="tidal/launch/auto.py's Choice: what the launch chose and why")

    @field_validator("rollout")
    @classmethod
    def _registered(cls, name: str) -> str:
        ROLLOUTS.get(name)  # ValueError: unknown rollout 'x'; known: ...
        return name

    def with_algorithm(self, name: str) -> "RunConfig":
        algorithm = get_algorithm(name)  # ValueError listing the known names
        try:
            algo_config = algorithm.config_cls.model_validate(self.algorithm)
        except ValidationError as exc:
            raise ValueError(config_error(exc, "algorithm section", prefix="algorithm.",
                                          model=algorithm.config_cls)) from None
        return self.model_copy(update={"algo": name, "algo_config": algo_config})

    @property
    def generator_model(self) -> ModelConfig:
        """The model as the generator loads it: in the trainer's compute dtype (bf16 / fp16 under
        trainer.precision=bf16 / fp16, whose pushes are in it), else in model.dtype."""
        compute = {"bf16": "bfloat16", "fp16": "float16"}.get(self.trainer.precision)
        return self.model.model_copy(update={"dtype": compute}) if compute else self.model

    @property
    def response_tokens(self) -> int:
        """The longest response: generator.max_new_tokens, or a multi-turn sample's whole budget."""
        return ROLLOUTS.get(self.rollout).response_tokens(self.multi_turn, self.generator.max_new_tokens)

    @property
    def reward_functions(self) -> list[str]:
        """reward.functions, or the default for the task: the embedded reward, or math_verify for a data file."""
        if self.reward.functions:
            return self.reward.functions
        if self.data.path:
            return ["math_verify"]
        return [ROLLOUTS.get(self.rollout).embedded_reward]

    def resolved(self) -> dict:
        """Everything the run used, algorithm defaults included (written to config.json)."""
        data = self.model_dump(mode="json")
        data["algo"] = self.algo
        data["algorithm"] = self.algo_config.model_dump(mode="json") if self.algo_config else self.algorithm
        return data

def non_defaults(cfg: RunConfig) -> list[tuple[str, object, str]]:
    """(dotted key, value, source) of every value a run took from somewhere else than the classes'
    defaults, for --dry-run and the start of a run."""
    from tidal.recipes.defaults import flatten

    return [(key, value, cfg.sources.get(key, "default")) for key, value in flatten(cfg.resolved()).items()
            if cfg.sources.get(key, "default") != "default"]

