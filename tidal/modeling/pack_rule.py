"""trainer.shared_prompt=auto's rule, torch-free: the trainer's packing (tidal/modeling/packing.py) and --dry-run's
memory estimate (tidal/launch/memory.py, which loads no model code) both ask it, so they cannot disagree."""
from __future__ import annotations

from typing import Sequence

# auto: share the prompt once it saves at least this fraction of the tokens a varlen row would carry.
# `bench/shared_prompt.py --auto` (G=8, R=500, CPU), varlen time / shared time in four runs: 0.86-0.97
# at 0.017 saved, 0.99-1.10 at 0.042, 0.97-1.24 at 0.08, 1.07-1.10 at 0.15, 1.13-1.18 at 0.25.
AUTO_MIN_SAVED = 0.05


def auto_shared_prompt(prompt_len: int, response_lens: Sequence[int]) -> bool:
    """On when sharing saves >= AUTO_MIN_SAVED of the varlen tokens: (G-1)·P / (G·P + ΣR).

    Sharing always runs fewer tokens through the linear layers; below the threshold that saving is
    smaller than what the blocks kernel spends on each response (copies of the prompt's K/V, extra
    calls, recomputed or tiled scores).
    """
    G = len(response_lens)
    if G < 2:
        return False
    saved = (G - 1) * prompt_len / (G * prompt_len + sum(response_lens))
    return saved >= AUTO_MIN_SAVED
