"""Char tokenizer, PromptFormatter (chat template / str.format, overlong, malformed) and PromptStream."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from grpo_jax.data import (
    DEFAULT_ALPHABET,
    IndexSampler,
    PromptFormatter,
    PromptStream,
    char_tokenizer,
    load_source,
)

CHAT = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


@pytest.fixture(scope="module")
def tok():
    return char_tokenizer()


# --- char tokenizer ---------------------------------------------------------------------------

def test_char_tokenizer_round_trip_and_ids(tok):
    text = DEFAULT_ALPHABET + "What is 37 + 48?\n  {x}"
    ids = tok.encode(text)
    assert len(ids) == len(text)  # one token per character, nothing added
    assert tok.decode(ids) == text
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    assert len(tok) == 4 + len(DEFAULT_ALPHABET)
    assert tok.encode("a\tb") == [tok.convert_tokens_to_ids("a"), 3, tok.convert_tokens_to_ids("b")]  # tab: <unk>
    with pytest.raises(ValueError, match="repeats"):
        char_tokenizer("abca")


@pytest.mark.parametrize("add_bos", [False, True])
def test_char_tokenizer_save_load(tmp_path, add_bos):
    tokenizer = char_tokenizer("0123456789+-= ?Wahtis\n", add_bos=add_bos, chat_template=CHAT)
    tokenizer.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = "What is 12 + 30?\n"
    assert loaded.encode(text) == tokenizer.encode(text)
    assert (loaded.encode(text)[0] == 1) == add_bos
    assert loaded.get_vocab() == tokenizer.get_vocab()
    assert loaded.decode(loaded.encode(text), skip_special_tokens=True) == text
    assert loaded.chat_template == CHAT
    specials = [loaded.pad_token, loaded.bos_token, loaded.eos_token, loaded.unk_token]
    assert specials == ["<pad>", "<bos>", "<eos>", "<unk>"]
    assert char_tokenizer().chat_template is None


# --- PromptFormatter --------------------------------------------------------------------------

def test_formatter_uses_chat_template_when_present():
    tokenizer = char_tokenizer(chat_template=CHAT)
    fmt = PromptFormatter(tokenizer, max_prompt_tokens=200, system_prompt="Be brief.")
    prompt = fmt.encode({"question": "What is 2 + 3?", "answer": "5"})
    assert prompt.text == "<|system|>Be brief.\n<|user|>What is 2 + 3?\n<|assistant|>"
    assert prompt.ids == tokenizer.encode(prompt.text, add_special_tokens=False)
    assert fmt({"question": "What is 2 + 3?"}) == prompt.ids
    plain = PromptFormatter(tokenizer, max_prompt_tokens=200, template="Q: {question}\nA:", chat_template="never")
    assert plain.encode({"question": "1+1"}).text == "Q: 1+1\nA:"


def test_formatter_template_without_chat_template(tok):
    template = "Numbers {numbers}, target {target}.\n"
    fmt = PromptFormatter(tok, max_prompt_tokens=200, template=template, system_prompt="Solve.")
    prompt = fmt.encode({"numbers": [3, 7], "target": 21, "answer": "3 * 7"})
    assert prompt.text == "Solve.\n\nNumbers [3, 7], target 21.\n"
    assert prompt.ids == tok.encode(prompt.text)
    with pytest.raises(ValueError, match="no chat template"):
        PromptFormatter(tok, max_prompt_tokens=10, chat_template="always")
    with pytest.raises(ValueError, match="positional"):
        PromptFormatter(tok, max_prompt_tokens=10, template="{} {0}")


def test_formatter_overlong_skip_vs_truncate():
    bos_tok = char_tokenizer(add_bos=True)
    row = {"question": "0123456789"}  # 11 tokens with <bos>
    skip = PromptFormatter(bos_tok, max_prompt_tokens=6)
    assert skip(row) is None and skip.stats["skipped_overlong"] == 1 and skip.stats["truncated"] == 0
    assert skip({"question": "01234"}) is not None  # exactly 6 tokens fits
    trunc = PromptFormatter(bos_tok, max_prompt_tokens=6, overlong="truncate")
    prompt = trunc.encode(row)
    assert prompt.ids == [1] + bos_tok.encode("56789", add_special_tokens=False)  # <bos> kept, end kept
    assert prompt.text == "56789"
    assert trunc.stats == {"formatted": 1, "skipped_overlong": 0, "skipped_malformed": 0, "truncated": 1}


@pytest.mark.parametrize("row", [
    {"answer": "5"},  # missing field
    {"question": None},  # wrong type
    {"question": {"text": "hi"}},
    {"question": "   "},  # empty prompt
    "What is 2 + 2?",  # not a dict
])
def test_formatter_malformed_rows_counted(tok, row):
    fmt = PromptFormatter(tok, max_prompt_tokens=100)
    assert fmt(row) is None
    assert fmt.stats["skipped_malformed"] == 1 and fmt.stats["formatted"] == 0
    assert fmt.last_skip_reason


def test_formatter_template_error_and_message_rows(tok):
    fmt = PromptFormatter(tok, max_prompt_tokens=100, template="{question} ({target:d})")
    assert fmt({"question": "q", "target": "not a number"}) is None  # format spec error
    assert "failed" in fmt.last_skip_reason and fmt.stats["skipped_malformed"] == 1
    chat = PromptFormatter(char_tokenizer(chat_template=CHAT), max_prompt_tokens=100, template=None)
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert chat.encode({"prompt": messages}).text == "<|system|>S\n<|user|>U\n<|assistant|>"
    assert chat({"prompt": [{"role": "user"}]}) is None
    plain = PromptFormatter(tok, max_prompt_tokens=100, template=None)
    assert plain({"prompt": messages}) is None and plain.encode({"prompt": "Hi"}).text == "Hi"


# --- PromptStream -----------------------------------------------------------------------------

def _rows():
    good = [{"question": f"What is {i} + 1?", "answer": str(i + 1), "id": f"r{i}"} for i in range(8)]
    bad = [{"answer": "0"}, {"question": None}, {"question": "x" * 500}]
    return good + bad


def test_stream_skips_bad_rows_and_keeps_going(tok):
    source = _rows()
    stream = PromptStream(source, IndexSampler(len(source), seed=0), PromptFormatter(tok, max_prompt_tokens=40))
    batches = [stream.next_batch(4) for _ in range(6)]  # more than two epochs
    examples = [e for b in batches for e in b]
    assert all(len(b) == 4 for b in batches)
    for e in examples:
        row = source[e.index]
        assert e.prompt_text == row["question"] and e.prompt_ids == tok.encode(row["question"])
        # The prompt's field is left out; its messages (before any chat template) are added for reward models.
        assert e.fields == {"answer": row["answer"], "id": row["id"],
                            "prompt_messages": [{"role": "user", "content": row["question"]}]}
    stats = stream.stats
    assert stats["formatted"] == 24 and stats["epoch"] >= 2
    assert stats["skipped_malformed"] >= 4 and stats["skipped_overlong"] >= 2
    assert stats["rows_read"] == 24 + stats["skipped_malformed"] + stats["skipped_overlong"]


def test_stream_resume_equals_uninterrupted(tok):
    source = _rows()

    def make():
        return PromptStream(source, IndexSampler(len(source), seed=4), PromptFormatter(tok, max_prompt_tokens=40))

    uninterrupted = make()
    uninterrupted.next_batch(5)
    restored = make()
    restored.load_state_dict(uninterrupted.state_dict())
    a = [e.index for _ in range(4) for e in uninterrupted.next_batch(3)]
    b = [e.index for _ in range(4) for e in restored.next_batch(3)]
    assert a == b and restored.stats == uninterrupted.stats


def test_stream_raises_when_an_epoch_yields_nothing(tok):
    source = [{"text": "no question field"}] * 5
    stream = PromptStream(source, IndexSampler(5, seed=0), PromptFormatter(tok, max_prompt_tokens=40))
    with pytest.raises(RuntimeError, match=r"whole epoch.*no field 'question'.*\['text'\]"):
        stream.next_batch(2)


def test_stream_over_a_tfds_source(tmp_path, tok):
    source = load_source("countdown", "train", data_dir=tmp_path, num_train=12, num_test=3)
    fmt = PromptFormatter(tok, max_prompt_tokens=200)
    batch = PromptStream(source, IndexSampler(len(source), seed=1), fmt).next_batch(5)
    assert len({e.index for e in batch}) == 5
    for e in batch:
        assert set(e.fields) == {"answer", "numbers", "target", "id", "prompt_messages"}
        assert e.prompt_text == source[e.index]["question"]
        assert f"reach {e.fields['target']}" in e.prompt_text
