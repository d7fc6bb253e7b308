"""Rebuild the shipped `tokenizer.json`: `python -m tidal.modeling.tiny.build_tokenizer`.

A byte-level BPE of 512 tokens trained on a generated corpus, so the embedded model needs no
download. Digits are split one per pre-token, so an answer digit is always a single token and
the embedded task's reward maps onto one sampling decision. The corpus and the trainer are
deterministic, so running this again writes the same file byte for byte.
"""
from __future__ import annotations

import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from tidal.modeling.tiny.task import NAMES, NOUNS, VERBS, embedded_prompts

EOS = "<|endoftext|>"
VOCAB_SIZE = 512
OUT_PATH = Path(__file__).with_name("tokenizer.json")

_FILLER = (
    "the", "a", "and", "of", "to", "in", "is", "it", "on", "for", "with", "as", "at", "by", "this",
    "that", "from", "or", "not", "but", "one", "two", "red", "blue", "big", "small", "old", "new",
    "run", "walk", "jump", "read", "write", "sing", "open", "close", "good", "bad", "yes", "no",
    "river", "hill", "house", "garden", "window", "table", "paper", "light", "water", "stone",
)


def corpus(*, n_lines: int = 4000, seed: int = 0) -> list[str]:
    """Task prompts with answers, plus word salad from the same lists, with numbers of any size."""
    rng = random.Random(seed)
    words = _FILLER + NAMES + NOUNS + VERBS
    lines = [f"{p['prompt']} {p['answer']}" for p in embedded_prompts(n_lines // 2, seed=seed)]
    for _ in range(n_lines - len(lines)):
        toks = [rng.choice(words) for _ in range(rng.randrange(4, 12))]
        toks.insert(rng.randrange(len(toks)), str(rng.randrange(1000)))
        lines.append(" ".join(toks) + rng.choice((" .", " ?", " !", ",")))
    return lines


def build() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[EOS],  # id 0
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),  # all 256 bytes, so any text encodes
        show_progress=False,
    )
    tok.train_from_iterator(corpus(), trainer=trainer)
    assert tok.get_vocab_size() == VOCAB_SIZE and tok.token_to_id(EOS) == 0
    return tok


if __name__ == "__main__":
    build().save(str(OUT_PATH))
    print(f"wrote {OUT_PATH}")
