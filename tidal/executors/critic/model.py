"""The critic's models: the value model (the policy's architecture with a one-output head per token)
and, for a KL in the reward, the reference (the initial policy), in the critic's own layout.

The value model is transformers' `AutoModelForTokenClassification` with num_labels=1: the decoder of
the policy, its last hidden state at each position through a `score` Linear(hidden, 1). The value at
the position that predicts response token t is V_t, the value of the prompt and the tokens before t.
Saved as an HF directory (checkpoints, final/critic), it loads back with that class.
"""
from __future__ import annotations

import logging
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import transformers
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule

from tidal.executors.base import ExecutorEnv
from tidal.modeling.hf import ATTN_IMPL, check_weights, in_own_memory, load_model, load_tokenizer
from tidal.executors.learner.config import LearnerConfig
from tidal.executors.learner.models import (PRECISIONS, LearnerModels, frozen_logprobs, lay_out, learner_mesh, save_full,
                                       trainable_copy)
from tidal.modeling.attention import install as install_attention


def load_value_model(path: str | None, *, dtype: torch.dtype, seed: int) -> transformers.PreTrainedModel:
    """From an HF directory (a causal LM: its decoder and a new head; a saved critic: all of it), or
    from the embedded policy's initial weights (`seed`) and a new head. A new head is initialised
    from `seed`, so every rank of the critic starts from the same one."""
    with torch.random.fork_rng(devices=[]), _quiet("transformers.modeling_utils", "transformers.distributed.tensor_parallel"):
        torch.manual_seed(seed)
        if path is not None:
            check_weights(path)
            config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
            config.num_labels, config.classifier_dropout = 1, 0.0  # dropout would make the values random
            return in_own_memory(transformers.AutoModelForTokenClassification.from_pretrained(
                path, config=config, local_files_only=True, dtype=dtype, attn_implementation=ATTN_IMPL))
        policy = load_model(None, dtype=dtype, seed=seed)
        config = policy.config.__class__.from_dict(policy.config.to_dict())
        config.num_labels, config.classifier_dropout = 1, 0.0
        config._attn_implementation = ATTN_IMPL
        model = transformers.AutoModelForTokenClassification.from_config(config).to(dtype)
        model.model.load_state_dict(policy.model.state_dict())
        return model


@contextmanager
def _quiet(*logger_names: str):
    """A causal LM loaded as a value model: HF reports the new head and the unused LM head, by design
    (and, with its loader's logger raised, checks a tensor-parallel plan we do not use)."""
    loggers = [logging.getLogger(name) for name in logger_names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


@dataclass
class ValueModels(LearnerModels):
    value: nn.Module  # what the forwards and backwards run on
    master: nn.Module  # what the optimizer steps and checkpoints save: `value` itself, or its fp32 master
    reference: nn.Module | None  # the initial policy (a causal LM), for a KL in the reward
    mesh: DeviceMesh | None
    tokenizer: object
    cfg: LearnerConfig
    temperature: float
    device: torch.device

    @classmethod
    def build(cls, *, value_path: str | None, model_path: str | None, dtype: torch.dtype, env: ExecutorEnv,
              cfg: LearnerConfig, temperature: float, reference: bool) -> "ValueModels":
        """value_path: where the value model starts (a resumed run: the checkpoint's critic/);
        model_path: the policy's initial model (the reference, the tokenizer)."""
        mesh = learner_mesh(env, cfg)
        master = load_value_model(value_path, dtype=dtype, seed=env.seed).to(env.device).train()
        value = trainable_copy(master, cfg)
        ref = None
        if reference:
            ref = load_model(model_path, dtype=dtype, seed=env.seed).to(env.device).eval().requires_grad_(False)
            ref = ref if cfg.fsdp else ref.to(PRECISIONS[cfg.precision] or dtype)
        for model in (value, ref):
            if model is not None:  # the critic runs default numerics
                install_attention(model, numerics="default", packed=cfg.shared_prompt != "padded")
        lay_out([(value, False), (ref, True)] + ([(master, True)] if master is not value else []), mesh=mesh, cfg=cfg)
        return cls(value, master, ref, mesh, load_tokenizer(model_path), cfg, temperature, env.device)

    def values(self, mb) -> torch.Tensor:
        """[N, T] float32 values of the micro-batch's response tokens (a graph when grad is enabled)."""
        return mb.values(self.value)

    def no_backward(self) -> None:
        """After a forward of the value model that no backward follows (a later mini-batch's group in
        the streamed phase): FSDP2 keeps a root's gathered weights for the backward it expects, and
        the next optimizer step would leave them stale (docs/architecture.md "Measured here")."""
        if isinstance(self.value, FSDPModule):
            self.value.reshard()

    def ref_logprobs(self, mbs: list, *, pad_to: int) -> list:
        return frozen_logprobs(self.reference, mbs, pad_to=pad_to, dummy=self.dummy, logprobs=lambda model, mb: mb.logprobs(
            model, temperature=self.temperature, chunk=self.cfg.logprob_chunk))

    def save(self, path, *, leader: bool) -> None:
        save_full(self.master, self.tokenizer, path, leader=leader)
