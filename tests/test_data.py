"""Prompt loading (JSONL, Parquet), error messages, length filtering and per-step batches."""
import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from executors.generator.data import PromptRow, PromptSet, load_prompts

WORDS = "user assistant the cat sat on a mat dog ran far away one two three four five six seven eight"
TEMPLATE = ("{% for m in messages %}<s> user {{ m['content'] }}{% endfor %}"
            "{% if add_generation_prompt %} assistant{% endif %}")


@pytest.fixture(scope="module")
def tokenizer():
    # A real fast tokenizer, one token per whitespace-separated word, built in milliseconds.
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([WORDS], trainers.WordLevelTrainer(special_tokens=["[UNK]", "<s>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="[UNK]", bos_token="<s>")


def _write_jsonl(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


def test_load_jsonl_and_json_lines(tmp_path):
    lines = [json.dumps({"prompt": "the cat", "answer": "1"}), "", json.dumps({"prompt": "a dog", "answer": 2, "id": 7})]
    for name in ("p.jsonl", "p.json"):
        rows = load_prompts(_write_jsonl(tmp_path / name, lines))
        assert rows == [PromptRow("the cat", {"answer": "1"}), PromptRow("a dog", {"answer": 2, "id": 7})]


def test_load_parquet(tmp_path):
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["the cat", "a dog"], "answer": ["1", "2"]}), path)
    assert load_prompts(str(path)) == [PromptRow("the cat", {"answer": "1"}), PromptRow("a dog", {"answer": "2"})]
    bad = tmp_path / "bad.parquet"
    pq.write_table(pa.table({"prompt": ["the cat", None]}), bad)
    with pytest.raises(ValueError, match=r"bad\.parquet: row 2: field 'prompt' is of type NoneType"):
        load_prompts(str(bad))


@pytest.mark.parametrize("bad_line, what", [
    ("{not json", "invalid JSON"),
    ("[1, 2]", "expected an object, got list"),
    (json.dumps({"question": "x"}), "field 'prompt' is missing"),
    (json.dumps({"prompt": 3}), "field 'prompt' is of type int, not a string"),
])
def test_malformed_line_names_file_and_line(tmp_path, bad_line, what):
    path = _write_jsonl(tmp_path / "d.jsonl", [json.dumps({"prompt": "ok"}), json.dumps({"prompt": "ok"}), bad_line])
    with pytest.raises(ValueError) as e:
        load_prompts(path)
    assert f"{path}:3: " in str(e.value) and what in str(e.value)


def test_empty_missing_and_unknown_files(tmp_path):
    empty = tmp_path / "e.jsonl"
    empty.write_text("\n\n", encoding="utf-8")
    with pytest.raises(ValueError, match="no rows"):
        load_prompts(str(empty))
    with pytest.raises(ValueError, match="does not exist"):
        load_prompts(str(tmp_path / "missing.jsonl"))
    (tmp_path / "p.csv").write_text("prompt\nx\n")
    with pytest.raises(ValueError, match="unknown format '.csv'"):
        load_prompts(str(tmp_path / "p.csv"))


def test_long_prompts_are_dropped_not_truncated(tokenizer):
    rows = [PromptRow("the cat", {}), PromptRow("the cat sat", {}), PromptRow("the cat sat on a mat", {})]
    ps = PromptSet(rows, tokenizer=tokenizer, max_prompt_tokens=3, apply_chat_template=False)
    assert (len(ps), ps.dropped) == (2, 1)
    prompts = {row.prompt: ids for _, row, ids in ps.batch(0, batch_size=2, seed=0)}
    assert prompts == {"the cat": tokenizer("the cat")["input_ids"], "the cat sat": tokenizer("the cat sat")["input_ids"]}
    with pytest.raises(ValueError, match="all 3 prompts"):
        PromptSet(rows, tokenizer=tokenizer, max_prompt_tokens=1, apply_chat_template=False)


def test_batches_are_deterministic_and_walk_epochs(tokenizer):
    words = WORDS.split()[-6:]  # six one-token prompts
    rows = [PromptRow(w, {"i": i}) for i, w in enumerate(words)]

    def make():
        return PromptSet(rows, tokenizer=tokenizer, max_prompt_tokens=8, apply_chat_template=False)

    a, b = make(), make()
    late = a.batch(5, batch_size=4, seed=3)  # asked first on `a`, last on `b`: order must not matter
    early = [a.batch(k, batch_size=4, seed=3) for k in range(5)]
    assert early == [b.batch(k, batch_size=4, seed=3) for k in range(5)]
    assert late == b.batch(5, batch_size=4, seed=3)
    assert [i for i, _, _ in late] == [0, 1, 2, 3]
    # Steps 0..2 of B=4 cover 12 positions = two full epochs: every prompt exactly twice.
    seen = [row.prompt for k in range(3) for _, row, _ in a.batch(k, batch_size=4, seed=3)]
    assert sorted(seen) == sorted(words * 2)
    other = [row.prompt for k in range(3) for _, row, _ in a.batch(k, batch_size=4, seed=4)]
    assert other != seen


def test_chat_template(tokenizer):
    rows = [PromptRow("the cat", {})]
    with pytest.raises(ValueError, match="no chat template"):
        PromptSet(rows, tokenizer=tokenizer, max_prompt_tokens=8, apply_chat_template=True)
    tokenizer.chat_template = TEMPLATE
    try:
        ps = PromptSet(rows, tokenizer=tokenizer, max_prompt_tokens=8, apply_chat_template=True)
    finally:
        tokenizer.chat_template = None
    [(_, _, ids)] = ps.batch(0, batch_size=1, seed=0)
    assert tokenizer.convert_ids_to_tokens(ids) == ["<s>", "user", "the", "cat", "assistant"]
