"""Model/tokenizer loading, the shipped tokenizer, and the embedded task."""
import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, Qwen2Config

from tidal.modeling.tiny import TOKENIZER_FILE
from tidal.modeling.tiny.build_tokenizer import build
from tidal.modeling.tiny.task import embedded_prompts, embedded_reward
from tidal.modeling.hf import load_model, load_tokenizer, save_hf

torch.set_num_threads(1)


def _equal_weights(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    return sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)


def test_embedded_model_is_deterministic_and_small():
    torch.manual_seed(123)
    expected_next = torch.rand(1)
    torch.manual_seed(123)
    a = load_model(None)
    assert torch.equal(torch.rand(1), expected_next)  # the caller's RNG stream is untouched
    assert _equal_weights(a, load_model(None))
    assert not _equal_weights(a, load_model(None, seed=1))
    assert type(a).__name__ == "Qwen3ForCausalLM" and a.config.vocab_size == len(load_tokenizer(None))
    assert 0.5e6 < sum(p.numel() for p in a.parameters()) < 1.5e6
    assert load_model(None, dtype=torch.bfloat16).model.embed_tokens.weight.dtype == torch.bfloat16


def test_save_hf_round_trip(tmp_path):
    model, tok = load_model(None, seed=4), load_tokenizer(None)
    save_hf(model, tok, tmp_path / "ckpt")
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in (tmp_path / "ckpt").iterdir()}
    for loaded in (load_model(str(tmp_path / "ckpt")), AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt")):
        assert _equal_weights(model, loaded)
    text = "eli sees 7 keys . how many ? answer: 7"
    for loaded in (load_tokenizer(str(tmp_path / "ckpt")), AutoTokenizer.from_pretrained(tmp_path / "ckpt")):
        assert loaded(text).input_ids == tok(text).input_ids
        assert loaded.eos_token_id == loaded.pad_token_id == tok.eos_token_id


@pytest.mark.parametrize("config_cls", [Qwen2Config, LlamaConfig])
def test_other_families_load_from_a_directory(tmp_path, config_cls):
    config = config_cls(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    save_hf(model, load_tokenizer(None), tmp_path)
    loaded = load_model(str(tmp_path))
    assert type(loaded) is type(model) and _equal_weights(model, loaded)


def test_missing_path_names_it(tmp_path):
    missing = str(tmp_path / "nowhere")
    for load in (load_model, load_tokenizer):
        with pytest.raises(ValueError, match="nowhere"):
            load(missing)


def test_embedded_tokenizer():
    tok = load_tokenizer(None)
    assert len(tok) == 512 and tok.eos_token == tok.pad_token == "<|endoftext|>" and tok.eos_token_id == 0
    assert tok.padding_side == "left"
    for text in ("bo and hal keeps 3 cups . how many ? answer: 3", "Unseen wörds, émoji 🙂 and 12345!"):
        ids = tok(text).input_ids
        assert tok.decode(ids) == text
    digit_ids = [tok.convert_tokens_to_ids(str(d)) for d in range(10)]
    assert tok("answer: 1234").input_ids[-4:] == digit_ids[1:5]  # one token per digit
    batch = tok(["a", "a b c"], padding=True, return_tensors="pt")
    assert batch.input_ids[0, 0] == tok.pad_token_id and batch.attention_mask[0].tolist()[-1] == 1


def test_shipped_tokenizer_is_reproducible():
    assert json.loads(build().to_str()) == json.loads(TOKENIZER_FILE.read_text())


def test_embedded_prompts_are_deterministic():
    a = embedded_prompts(50, seed=0)
    assert a == embedded_prompts(50, seed=0) and a[:10] == embedded_prompts(10, seed=0)
    assert a != embedded_prompts(50, seed=1)
    for s in a:
        assert s["answer"] in s["prompt"] and len(s["answer"]) == 1 and s["prompt"].endswith("answer:")
        assert sum(c.isdigit() for c in s["prompt"]) == 1


@pytest.mark.parametrize("response,reward", [
    ("", 0.0), (" none", 0.0), (" 7", 1.0), ("7<junk>", 1.0), (" 4", 0.0), (" x 7 4", 1.0),
    (" 4 7", 0.5), ("4447", 0.5), ("²", 0.0), ("seven", 0.0), ("77", 1.0),
])
def test_embedded_reward(response, reward):
    sample = {"prompt": "eli sees 7 keys . how many ? answer:", "answer": "7"}
    assert embedded_reward(sample["prompt"], response, sample) == reward


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_tokenizer_loads_without_the_model_stack(tmp_path, family):
    """load_tokenizer gives AutoTokenizer's tokenizer without importing the model's config class and
    with it transformers' model stack (the reward ranks need only the tokenizer: start-up)."""
    import subprocess
    import sys
    from pathlib import Path

    model = load_model(None)
    if family == "llama":
        cfg = LlamaConfig(vocab_size=model.config.vocab_size, hidden_size=48, intermediate_size=96, num_hidden_layers=1,
                          num_attention_heads=3, num_key_value_heads=1, head_dim=16)
        model = AutoModelForCausalLM.from_config(cfg)
    save_hf(model, load_tokenizer(None), tmp_path)
    ours, ref = load_tokenizer(str(tmp_path)), AutoTokenizer.from_pretrained(tmp_path, local_files_only=True)
    assert type(ours) is type(ref)
    for text in ("ana has 3 cats . how many ? answer:", "x<|endoftext|> 12+3", ""):
        ids = ref(text).input_ids
        assert ours(text).input_ids == ids
        assert ours.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    assert (ours.eos_token_id, ours.pad_token_id, ours.padding_side) == (ref.eos_token_id, ref.pad_token_id,
                                                                           ref.padding_side)
    root = Path(__file__).resolve().parents[1]
    probe = (f"import sys; from tidal.modeling.hf import load_tokenizer; load_tokenizer({str(tmp_path)!r}); "
             f"print(sorted(m for m in sys.modules if m.endswith(('core_model_loading', 'modeling_utils', "
             f"'configuration_{family}'))))")
    out = subprocess.run([sys.executable, "-c", probe], cwd=root, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stdout + out.stderr[-2000:]
