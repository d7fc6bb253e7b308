"""Assets that let Tidal run with nothing downloaded: a tokenizer, a tiny model recipe, a task."""
from pathlib import Path

TOKENIZER_FILE = Path(__file__).with_name("tokenizer.json")
EOS_TOKEN = "<|endoftext|>"  # also the pad token; id 0 (see build_tokenizer.py)
