"""Shared builders for tests: a small run config and real rollout groups from the real engine."""
from __future__ import annotations

import torch

from tidal.channels.payloads import ScoredGroup
from tidal.modeling.tiny.task import embedded_prompts, embedded_reward
from tidal.executors.generator.contract import PromptRequest, SamplingParams
from tidal.executors.generator.native_engine import NativeEngine
from tidal.modeling.hf import load_model, load_tokenizer
from tidal.recipes.config import RunConfig

SMALL = {"data": {"prompts_per_step": 4}, "generator": {"samples_per_prompt": 4, "max_new_tokens": 4}}


def small_config(algo: str = "grpo", **sections) -> RunConfig:
    data = {k: dict(v) for k, v in SMALL.items()}
    for key, value in sections.items():
        if isinstance(value, dict):
            data.setdefault(key, {}).update(value)
        else:
            data[key] = value
    return RunConfig.model_validate(data).with_algorithm(algo)


def scored_groups(*, n: int = 4, G: int = 4, step: int = 0, seed: int = 0, max_new_tokens: int = 5,
                  spread: bool = True, temperature: float = 0.9) -> list[ScoredGroup]:
    """Real samples of the embedded model on the embedded task, scored by the embedded reward.

    `spread`: add (sum of token ids % 5) / 4 so even an untrained model's groups have reward variance.
    """
    tok = load_tokenizer(None)
    engine = NativeEngine(load_model(None, seed=seed), eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    rows = embedded_prompts(n, seed=seed)
    requests = [PromptRequest(index=i, prompt_ids=tok(r["prompt"])["input_ids"]) for i, r in enumerate(rows)]
    params = SamplingParams(n=G, max_new_tokens=max_new_tokens, seed=seed, temperature=temperature)
    out = []
    for done in engine.generate(requests, params, step=step):
        row = rows[done.index]
        texts = tok.batch_decode(done.response_ids, skip_special_tokens=True)
        rewards = torch.tensor([embedded_reward(row["prompt"], t, {"answer": row["answer"]}) for t in texts])
        if spread:
            rewards += torch.tensor([(int(r.sum()) % 5) / 4 for r in done.response_ids])
        out.append(ScoredGroup(step=step, index=done.index, prompt=row["prompt"], extras={"answer": row["answer"]},
                               prompt_ids=done.prompt_ids_P, responses=done.response_ids, logprobs=done.logprobs,
                               finished=done.finished_G, rewards=rewards, reward_failures=0))
    return sorted(out, key=lambda g: g.index)
