"""The native engine's record of an MoE model's routing, for the trainer to replay (tidal/modeling/moe.py).

The engine is handed a recorder by its builder and tells it, after each forward, what that forward
fed; the recorder keeps the expert ids of each group's prompt and of every token its samples fed,
and hands them out with the group. A dense model's engine gets `NO_ROUTING`, which records nothing,
so the decode loop has no MoE branches. Only single-turn groups generated whole are recorded (`start`):
a resumed group's tokens and an observation are fed in shapes whose routing the trainer computes itself.
"""
from __future__ import annotations

import torch

from tidal.modeling import moe


class RoutingRecorder:
    def __init__(self, routing: moe.Routing):
        self.routing, self.shape, self.T = routing, routing.shape, 0
        self._prompts: dict[int, torch.Tensor] = {}  # prompt index -> [P, L, k]
        self._tokens: dict[int, torch.Tensor] = {}  # prompt index -> [G, T, L, k], UNRECORDED where none

    def start(self, *, whole_single_turn: bool, max_new_tokens: int) -> None:
        """A generate call begins: its forwards are recorded if its groups are single-turn and whole."""
        self.T = max_new_tokens
        self.routing.mode = "record" if whole_single_turn else "off"
        self.routing.recorded = []

    def _take(self, B: int, W: int) -> torch.Tensor | None:
        """The ids the forward just run chose for its [B, W] tokens, [B, W, L, k] compact, on the CPU."""
        recorded, self.routing.recorded = self.routing.recorded, []
        if not recorded:
            return None
        ids = torch.stack(recorded, dim=1).view(B, W, len(self.shape.layers), -1)
        return ids.to(self.shape.id_dtype).cpu()

    def prefilled(self, prompts: list[tuple[int, int]], *, width: int, samples: int) -> None:
        """A prefill of (prompt index, length) prompts, right-aligned in `width` columns."""
        ids_CWLk = self._take(len(prompts), width)
        if ids_CWLk is None:
            return
        for c, (index, length) in enumerate(prompts):
            self._prompts[index] = ids_CWLk[c, width - length:]
            self._tokens[index] = torch.full((samples, self.T, len(self.shape.layers), self.shape.top_k),
                                             moe.UNRECORDED).to(self.shape.id_dtype)

    def decoded(self, keys: list[tuple[int, int]], *, fed_B: torch.Tensor, t_B: torch.Tensor) -> None:
        """A decode forward over samples `keys` ((prompt index, sample) of each batch row): row b fed its token
        t_B[b] - 1 where fed_B[b] (a row past its end feeds a pad, which is not recorded)."""
        ids_B1Lk = self._take(len(fed_B), 1)
        if ids_B1Lk is None:
            return
        for b in fed_B.nonzero()[:, 0].tolist():
            index, sample = keys[b]
            self._tokens[index][sample, int(t_B[b]) - 1] = ids_B1Lk[b, 0]

    def group(self, index: int, lengths: list[int]) -> list[torch.Tensor] | None:
        """A finished group's routing as it travels ([prompt, response_1..G], moe.pack); None: not recorded."""
        if index not in self._prompts:
            return None
        tokens = self._tokens.pop(index)
        return moe.pack(self._prompts.pop(index), [tokens[j, :n] for j, n in enumerate(lengths)], self.shape)


class _NoRouting:
    """A dense model's recorder: nothing to record."""

    def start(self, *, whole_single_turn: bool, max_new_tokens: int) -> None:
        pass

    def prefilled(self, prompts, *, width: int, samples: int) -> None:
        pass

    def decoded(self, keys, *, fed_B, t_B) -> None:
        pass

    def group(self, index: int, lengths: list[int]) -> None:
        return None


NO_ROUTING = _NoRouting()


def recorder_for(model) -> RoutingRecorder | _NoRouting:
    """An MoE model's recorder (its routers hooked, tidal/modeling/moe.py install), or NO_ROUTING."""
    routing = moe.install(model)
    return NO_ROUTING if routing is None else RoutingRecorder(routing)
