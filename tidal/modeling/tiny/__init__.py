"""Assets that let Tidal run with nothing downloaded: a tokenizer, a tiny model recipe, a task."""
from pathlib import Path

TOKENIZER_FILE = Path(__file__).with_name("tokenizer.json")
EOS_TOKEN = "<|endoftext|>"  # also the pad token; id 0 (see build_tokenizer.py)
VOCAB_SIZE = 512  # the tokenizer's, special token included
# the embedded tiny Qwen3 (~0.85M parameters), as Qwen3Config fields (a plain dict: --dry-run reads
# it without loading transformers)
MODEL_SIZES = dict(vocab_size=VOCAB_SIZE, hidden_size=128, num_hidden_layers=4, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=32, intermediate_size=384, max_position_embeddings=1024,
                   tie_word_embeddings=True)
