"""A reward-model executor: a sequence-classification head scores each [prompt, response].

The reward model reads the policy's token ids as they are, so it must share the policy's tokenizer
(the embedded default does). `path=None` builds a tiny random-init Qwen3 classifier from the
embedded config: useless as a judge, but a real HF model that runs anywhere without a download.
"""
from __future__ import annotations

import logging
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch

from tidal.channels.payloads import RolloutGroup, ScoredGroup
from tidal.executors.base import Executor, ExecutorEnv, Input, Output, StepContext
from tidal.executors.reward.config import RewardModelConfig


@dataclass(frozen=True)
class RewardModelMetrics:
    rm_score_s: float
    rm_reward_mean: float  # over this replica's groups


class RewardModel(Executor):
    rollouts = Input(RolloutGroup)
    scored = Output(ScoredGroup)

    def __init__(self, *, name: str = "reward_model", config: RewardModelConfig):
        super().__init__(name=name, units=config.replicas)
        self.cfg = config
        if config.path is not None and not (Path(config.path) / "config.json").is_file():
            # checked at build time, so every rank fails before any of them blocks
            raise ValueError(f"reward model: no Hugging Face model directory at {config.path!r} "
                             f"(expected {Path(config.path) / 'config.json'})")

    def describe(self):
        return {"replicas": self.cfg.replicas, "model": self.cfg.path or "embedded (random)", "scale": self.cfg.scale}

    def init(self, env: ExecutorEnv) -> None:
        super().init(env)
        self.model = load_reward_model(self.cfg.path, seed=self.cfg.seed).to(env.device).eval()

    def step(self, ctx: StepContext):
        busy, total, n = 0.0, 0.0, 0
        for group in ctx.inbound[self.rollouts]:
            t0 = time.perf_counter()
            with ctx.timeline.span("scored", index=group.index):
                rewards_G = self.score(group)
            ctx.outbound[self.scored].send(ScoredGroup(**vars(group), rewards=rewards_G, reward_failures=0,
                                                        reward_parts={"reward_model": rewards_G.tolist()}))
            busy += time.perf_counter() - t0
            total, n = total + rewards_G.double().sum().item(), n + rewards_G.numel()
        # own key names: the metrics of all executors share one row per step
        return RewardModelMetrics(rm_score_s=busy, rm_reward_mean=total / max(n, 1))

    @torch.inference_mode()
    def score(self, group: RolloutGroup) -> torch.Tensor:
        """[G] float32: scale * the classifier's logit at the last token of each [prompt, response]."""
        seqs = [torch.cat([group.prompt_ids, r]).to(torch.int64) for r in group.responses]
        vocab = self.model.get_input_embeddings().num_embeddings
        top = max(int(s.max()) for s in seqs)
        if top >= vocab:
            raise ValueError(f"reward model: token id {top} is outside its vocabulary ({vocab}); it must "
                             "share the policy's tokenizer")
        T = max(s.numel() for s in seqs)
        # left padding: every sequence ends in the last column, so the pooled logit at -1 is its own
        ids_GT = torch.zeros(len(seqs), T, dtype=torch.int64)
        mask_GT = torch.zeros(len(seqs), T, dtype=torch.int64)
        for g, s in enumerate(seqs):
            ids_GT[g, T - s.numel():] = s
            mask_GT[g, T - s.numel():] = 1
        device = self.env.device if self.env else torch.device("cpu")
        ids_GT, mask_GT = ids_GT.to(device), mask_GT.to(device)
        pos_GT = (mask_GT.cumsum(-1) - 1).clamp(min=0)  # positions restart at 0 after the padding
        # inputs_embeds, not input_ids: HF would otherwise pool at the last token != pad_token_id, and
        # the embedded pad id is EOS, which ends many responses
        embeds_GTD = self.model.get_input_embeddings()(ids_GT)
        with _quiet("transformers.modeling_layers"):
            logits_G1 = self.model(inputs_embeds=embeds_GTD, attention_mask=mask_GT, position_ids=pos_GT).logits
        return (self.cfg.scale * logits_G1[:, 0]).float().cpu()


def load_reward_model(path: str | None, *, seed: int):
    """A one-logit AutoModelForSequenceClassification from a local directory, or the tiny random one."""
    # model code loads here, on the reward model's ranks: building a graph (the CLI, --dry-run) stays light
    import transformers

    from tidal.modeling.hf import ATTN_IMPL, embedded_config, load_tokenizer

    # fork_rng: a new head (or the random model) is initialised from `seed`, the caller's RNG untouched
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        if path is not None:
            model = transformers.AutoModelForSequenceClassification.from_pretrained(
                path, local_files_only=True, num_labels=1, attn_implementation=ATTN_IMPL)
        else:
            tok = load_tokenizer(None)
            config = embedded_config(vocab_size=len(tok), eos_token_id=tok.eos_token_id)
            config.num_labels = 1
            config._attn_implementation = ATTN_IMPL
            model = transformers.Qwen3ForSequenceClassification(config)
    # HF refuses batches of more than one sequence without a pad id, even when given embeddings
    if model.config.pad_token_id is None:
        eos = model.config.eos_token_id
        model.config.pad_token_id = (eos[0] if isinstance(eos, list) else eos) if eos is not None else 0
    return model


@contextmanager
def _quiet(logger_name: str):
    """Silence HF's one-time "padding not detected with inputs_embeds" warning: we pad on the left."""
    logger = logging.getLogger(logger_name)
    level = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(level)
