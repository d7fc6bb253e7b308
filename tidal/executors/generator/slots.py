"""The native engine's decode state: N samples in fixed slots on the device, with their KV.

One object owns the rows, the KV and what a forward sees (nano-vllm's split: the drivers in drivers.py
schedule, this runs). A sample holds its slot from admission until its group is copied out; the slot then goes
to the next prompt. Per slot, on the device: its seed, the next position it feeds, the tokens and log-probs it
has written (a [N, T] response buffer), whether it hit EOS or its stop, and the token it samples next (drawn
from its last forward's logits). The KV lives in tidal/modeling/slot_attention.py's store. Nothing is cut out,
concatenated or reallocated between tokens: a decode step is the same few indexed writes and one forward over
the slots that decode (`write`, `decode`), and the host learns which samples ended from one small copy.

The host keeps one thing per slot: the next position each slot feeds (`hpos`), which advances by amounts the host
itself decides, so the forward's key width is known without reading the device.
"""
from __future__ import annotations

import numpy as np
import torch

from tidal.executors.generator.sampling import sample_tokens
from tidal.modeling.parallel import local
from tidal.modeling.slot_attention import ATTN_NAME, SlotForward, SlotStore, slot_forward


class Slots:
    def __init__(self, engine, params, *, slots: int, length: int, response: int):
        """slots: N; length: the longest sequence a slot holds (prompt and response); response: T, the most
        tokens a sample writes (with turns: its observations too)."""
        dev, self.engine, self.params = engine.device, engine, params
        self.N, self.T, self.S = slots, response, length
        # one slot more than the samples': the scratch slot, which a batch padded to its bucket fills
        # (tidal/executors/generator/graphs.py); it has always ended, so it writes nothing and feeds pads
        self.scratch = slots
        self.store = SlotStore(slots=slots + 1, length=length, exact=engine.exact)

        def zeros(dtype=torch.long, *shape):
            return torch.zeros(slots + 1, *shape, dtype=dtype, device=dev)

        self.seed_N, self.pos_N, self.len_N, self.stop_N = zeros(), zeros(), zeros(), zeros()
        self.eos_N, self.ended_N = zeros(torch.bool), zeros(torch.bool)
        self.tokens_NT = torch.full((slots + 1, response), engine.pad_token_id, dtype=torch.long, device=dev)
        self.logp_NT, self.sampled_NT = zeros(torch.float32, response), zeros(torch.bool, response)
        self.next_tok_N, self.next_logp_N = zeros(), zeros(torch.float32)
        self.ended_N[self.scratch] = True
        self.hpos = np.zeros(slots + 1, dtype=np.int64)
        self.free: list[int] = list(range(slots))
        self.busy = True  # a stream decodes in them

    def reset(self, params) -> None:
        """Every slot free again, for the next call (a slot's state is set when a sample takes it)."""
        self.params, self.free, self.busy = params, list(range(self.N)), True
        self.hpos[:] = 0

    def take(self, n: int) -> list[int]:
        taken, self.free = self.free[:n], self.free[n:]
        assert len(taken) == n, "admission asked for more slots than are free"
        return taken

    def give_back(self, slots: list[int]) -> None:
        self.free = sorted(self.free + slots)

    def rows_of(self, slots: list[int]) -> torch.Tensor:
        return torch.tensor(slots, dtype=torch.long, device=self.engine.device)

    def start(self, slots: list[int], *, seeds: list[int], stop: list[int], written: list[tuple] | None = None) -> None:
        """Fresh samples in `slots` (their positions from 0; written: each one's (tokens, log-probs, ended, sampled
        mask or None) so far, a resumed sample's)."""
        rows = self.rows_of(slots)
        dev = self.engine.device
        self.seed_N[rows] = torch.tensor(seeds, device=dev)
        self.stop_N[rows] = torch.tensor(stop, device=dev)
        self.pos_N[rows] = self.len_N[rows] = 0
        self.eos_N[rows] = self.ended_N[rows] = False
        self.tokens_NT[rows] = self.engine.pad_token_id
        self.logp_NT[rows] = 0.0
        self.sampled_NT[rows] = False
        self.hpos[slots] = 0
        for s, (ids, logp, ended, sampled) in zip(slots, written or []):
            n = ids.numel()
            self.tokens_NT[s, :n], self.logp_NT[s, :n] = ids.to(dev), logp.to(dev)
            if sampled is not None:
                self.sampled_NT[s, :n] = sampled.to(dev)
            self.len_N[s], self.eos_N[s], self.ended_N[s] = n, bool(ended), bool(ended)

    def forward(self, slots: list[int], chunks: list[list[int]] | list[torch.Tensor]) -> torch.Tensor:
        """Feed each slot its chunk of tokens at its next positions, right-aligned (padding first, position -1):
        the logits after each chunk's last token, [B, V] float32."""
        W = max(len(c) for c in chunks)
        ids_BW = torch.full((len(slots), W), self.engine.pad_token_id, dtype=torch.long)
        pos_BW = torch.full((len(slots), W), -1, dtype=torch.long)
        for b, (s, c) in enumerate(zip(slots, chunks)):
            n = len(c)
            ids_BW[b, W - n:] = torch.as_tensor(c, dtype=torch.long)
            pos_BW[b, W - n:] = torch.arange(self.hpos[s], self.hpos[s] + n)
            self.hpos[s] += n
        dev = self.engine.device
        rows = self.rows_of(slots)
        self.pos_N[rows] = torch.as_tensor(self.hpos[slots], device=dev)
        return self._run(rows, ids_BW.to(dev), pos_BW.to(dev), width=int(self.hpos[slots].max()), slots=slots)

    def _run(self, rows_B: torch.Tensor, ids_BW: torch.Tensor, pos_BW: torch.Tensor, *, width: int,
             slots: list[int] | None) -> torch.Tensor:
        span = (slots[0], slots[-1] + 1) if slots and slots == list(range(slots[0], slots[-1] + 1)) else None
        fwd = SlotForward(self.store, rows_B, pos_BW, width=width, span=span)
        model = self.engine.model
        # the slots' attention for this forward only: the model is the engine's, but a caller (a test's reference,
        # the trainer's copy before a push) may run it as it was loaded between two steps
        config, was = model.config, model.config._attn_implementation
        config._attn_implementation = ATTN_NAME
        try:
            with slot_forward(fwd):
                out = model(input_ids=ids_BW, position_ids=pos_BW.clamp(min=0), use_cache=False,
                            attention_mask=torch.ones_like(ids_BW), logits_to_keep=1)
        finally:
            config._attn_implementation = was
        return out.logits[:, -1].float()

    def share(self, src: list[int], dst: list[int], *, columns: int) -> None:
        """Slots dst[c] take what src[c] has fed (its first `columns` positions): a prompt's samples share its prefill."""
        src_C, dst_C = self.rows_of(src), self.rows_of(dst)
        self.store.share(src_C, dst_C, columns=columns)
        self.pos_N[dst_C] = self.pos_N[src_C]
        self.hpos[dst] = self.hpos[src]

    def sample(self, rows_B: torch.Tensor, logits_BV: torch.Tensor) -> None:
        """The token each row samples next, from its logits: drawn by its seed at its response position."""
        p = self.params
        self.next_tok_N[rows_B], self.next_logp_N[rows_B] = sample_tokens(
            logits_BV, seeds_R=self.seed_N[rows_B], t=self.len_N[rows_B], temperature=p.temperature, top_p=p.top_p,
            top_k=p.top_k)

    def write(self, rows_B: torch.Tensor) -> torch.Tensor:
        """Each row that has not ended writes the token it sampled; it ends at EOS or at its stop. Device only:
        returns ended_B (the host reads it when it chooses)."""
        T, eos = self.T, self.engine.eos_token_id
        tok_B, t_B = self.next_tok_N[rows_B], self.len_N[rows_B]
        live_B = ~self.ended_N[rows_B]
        col_B = t_B.clamp(max=T - 1)
        self.tokens_NT[rows_B, col_B] = torch.where(live_B, tok_B, self.tokens_NT[rows_B, col_B])
        self.logp_NT[rows_B, col_B] = torch.where(live_B, self.next_logp_N[rows_B], self.logp_NT[rows_B, col_B])
        self.sampled_NT[rows_B, col_B] |= live_B
        self.len_N[rows_B] = t_B + live_B.long()
        hit_B = live_B & (tok_B == eos)
        self.eos_N[rows_B] |= hit_B
        ended_B = ~live_B | hit_B | (t_B + 1 >= self.stop_N[rows_B])
        self.ended_N[rows_B] = ended_B
        return ended_B

    def decode(self, slots: list[int], rows_B: torch.Tensor) -> torch.Tensor:
        """Feed each row its newest token (a pad where it has ended) at its next position; then sample the next.
        Returns fed_B: the rows that fed a token."""
        self.hpos[slots] += 1
        # an ended row fed pads past the store until the host read its end (check_every): no live query is there
        return self.decode_on_device(rows_B, width=min(int(self.hpos[slots].max()), self.S), slots=slots)

    def decode_on_device(self, rows_B: torch.Tensor, *, width: int, slots: list[int] | None = None) -> torch.Tensor:
        """decode's device work alone: fixed shapes for fixed rows_B and width, no read of the device (what a
        CUDA graph captures, tidal/executors/generator/graphs.py)."""
        fed_B = ~self.ended_N[rows_B]
        ids_B1 = torch.where(fed_B, self.next_tok_N[rows_B], self.engine.pad_token_id)[:, None]
        pos_B1 = self.pos_N[rows_B][:, None]
        self.pos_N[rows_B] += 1
        logits_BV = self._run(rows_B, ids_B1, pos_B1, width=width, slots=slots)
        self.sample(rows_B, logits_BV)
        return fed_B

    def observe(self, slot: int, obs: list[int]) -> None:
        """A multi-turn sample's observation joins its response (not sampled: its loss mask stays False); the
        sample decodes again."""
        n = int(self.len_N[slot])
        self.tokens_NT[slot, n:n + len(obs)] = torch.tensor(obs, dtype=torch.long, device=self.tokens_NT.device)
        self.len_N[slot] = n + len(obs)
        self.ended_N[slot] = self.eos_N[slot] = False

    def copy_out(self, slot: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A sample's response: its tokens, log-probs and sampled mask (plain tensors on the CPU, not views)."""
        n = int(self.len_N[slot])
        return (self.tokens_NT[slot, :n].cpu().clone(), self.logp_NT[slot, :n].cpu().clone(),
                self.sampled_NT[slot, :n].cpu().clone())


def free_memory_bytes(device: torch.device) -> int | None:
    """What a new allocation on `device` may take: the device's free memory and what torch's allocator holds
    unused (GPU/NPU), or the host's MemAvailable (CPU); None where it cannot be read."""
    if device.type in ("cuda", "npu"):
        backend = getattr(torch, device.type)
        free, _ = backend.mem_get_info(device)
        return free + backend.memory_reserved(device) - backend.memory_allocated(device)
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None
    return kib * 1024


def kv_bytes_per_position(model) -> int:
    """One slot position's keys and values over every layer, in this rank's store (a tp shard's key heads): each
    layer's k_proj rows are its key heads x head dim, in the dtype its keys are stored in."""
    rows = [(local(m.weight).shape[0], m.weight.element_size()) for name, m in model.named_modules()
            if name.endswith("k_proj") and hasattr(m, "weight")]
    if rows:
        return sum(2 * n * size for n, size in rows)
    c = model.config  # fused projections: the config's whole heads (a tp shard holds fewer: an upper bound)
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    kv_heads = getattr(c, "num_key_value_heads", None) or c.num_attention_heads
    return 2 * c.num_hidden_layers * kv_heads * head_dim * next(model.parameters()).element_size()
