"""Tokenizers rebuilt from GGUF metadata: the default model's, and small synthetic ones."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvchat.errors import ModelLoadError
from kvchat.model.gguf.file import GGUFFile
from kvchat.model.gguf.tokenizer import (
    TOKEN_BYTE,
    TOKEN_CONTROL,
    TOKEN_NORMAL,
    TOKEN_USER_DEFINED,
    GGUFTokenizerParts,
    gguf_tokenizer,
)

MIXED_TEXT = (
    "Ünïcödé — 漢字 and 🤖 emoji\n"
    "def area(r: float) -> float:\n\treturn 3.14159 * r ** 2  # 12345 digits\n"
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n  trailing  "
)


@pytest.fixture
def gguf_path(default_gguf_path: Path) -> Path:
    """The default model's GGUF (conftest fetches it once)."""
    return default_gguf_path


@pytest.fixture
def smollm(gguf_path: Path) -> GGUFTokenizerParts:
    return gguf_tokenizer(GGUFFile.open(gguf_path).metadata)


@pytest.mark.real_model
def test_chat_markers_are_single_special_ids(smollm: GGUFTokenizerParts) -> None:
    ids = smollm.backend.encode("<|im_start|>assistant\nhi<|im_end|>").ids
    assert ids[0] == 1
    assert ids[-1] == 2
    assert smollm.backend.token_to_id("<|im_start|>") == 1
    assert smollm.backend.decode(ids, skip_special_tokens=True) == "assistant\nhi"


@pytest.mark.real_model
def test_default_model_parts(smollm: GGUFTokenizerParts) -> None:
    assert smollm.bos_token == "<|im_start|>"
    assert smollm.eos_token == "<|im_end|>"
    assert smollm.eos_token_id == 2
    assert smollm.add_bos_token is False
    assert smollm.chat_template is not None and "<|im_start|>" in smollm.chat_template
    assert smollm.backend.get_vocab_size() == 49152


@pytest.mark.real_model
def test_digits_are_split_one_by_one(smollm: GGUFTokenizerParts) -> None:
    encoding = smollm.backend.encode("12345")
    assert encoding.tokens == ["1", "2", "3", "4", "5"]


@pytest.mark.real_model
def test_decode_of_encode_round_trips_mixed_text(smollm: GGUFTokenizerParts) -> None:
    ids = smollm.backend.encode(MIXED_TEXT).ids
    assert smollm.backend.decode(ids, skip_special_tokens=False) == MIXED_TEXT


@pytest.mark.real_model
def test_ids_match_transformers_except_whitespace_before_digits(gguf_path: Path, smollm) -> None:
    """Compare with the tokenizer transformers builds from the same GGUF.

    They differ only where a run of whitespace precedes a digit. transformers
    gives the file plain GPT-2 ByteLevel splitting, which cuts "  9" into
    " " + " 9"; SmolLM2's own tokenizer.json (what the model was trained with,
    and our reference) first isolates each digit (Digits(individual_digits)),
    so the whole run "  " stays one piece: "ĠĠ" (256) + "9" instead of
    "Ġ" "Ġ" "9" (216 216 41). Texts without that pattern agree exactly.
    """
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(gguf_path.parent), gguf_file=gguf_path.name)

    def hf_ids(text: str) -> list[int]:
        return hf.encode(text, add_special_tokens=False)

    same = [
        "Hello world",
        "12345",
        "in 2024 we had 3 cats",
        "x = 10\n  y=20",
        "<|im_start|>user\nhi<|im_end|>\n",
        "  leading spaces and trailing  ",
        "ünïcödé 漢字 🤖 emoji",
        "def f(a, b):\n\treturn a+b  # sum\n",
        "price: $3.50, 1,000",
    ]
    for text in same:
        assert smollm.backend.encode(text).ids == hf_ids(text), text

    ours = smollm.backend.encode(" 7 8  9").ids
    assert ours == [216, 39, 216, 40, 256, 41]
    assert hf_ids(" 7 8  9") == [216, 39, 216, 40, 216, 216, 41]
    assert smollm.backend.encode("tabs\t\t2").ids != hf_ids("tabs\t\t2")


# ---- synthetic vocabularies ------------------------------------------------------------------


def byte_level_metadata(pre: str) -> dict[str, object]:
    tokens = ["<|endoftext|>", "<|ctl|>", "<think>", "a", "b", "ab", "Ġ", "Ġab", "1", "2", "12"]
    types = [TOKEN_CONTROL, TOKEN_CONTROL, TOKEN_USER_DEFINED] + [TOKEN_NORMAL] * 8
    return {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": pre,
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.merges": ["a b", "Ġ ab", "1 2"],
        "tokenizer.ggml.eos_token_id": 0,
    }


def test_control_and_user_defined_tokens_stay_whole() -> None:
    parts = gguf_tokenizer(byte_level_metadata("smollm"))
    enc = parts.backend.encode("<|ctl|>ab<think> ab")
    assert enc.ids == [1, 5, 2, 7]
    # Control tokens are special (dropped on request), user-defined ones are text.
    assert parts.backend.decode(enc.ids, skip_special_tokens=True) == "ab<think> ab"
    assert parts.eos_token == "<|endoftext|>" and parts.bos_token is None
    assert parts.add_bos_token is False


@pytest.mark.parametrize(("pre", "expected"), [("smollm", [8, 9]), ("llama-bpe", [10])])
def test_pre_tokenizer_follows_the_file_s_name(pre: str, expected: list[int]) -> None:
    assert gguf_tokenizer(byte_level_metadata(pre)).backend.encode("12").ids == expected


def test_qwen35s_pre_tokenizer_is_transformers_qwen3_5_split() -> None:
    """llama.cpp's `qwen35`: Qwen2's split with combining marks kept with their letters,
    after NFC, as transformers' Qwen3.5 tokenizer splits."""
    from tokenizers import Regex, pre_tokenizers
    from transformers.models.qwen3_5.tokenization_qwen3_5 import PRETOKENIZE_REGEX

    theirs = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(PRETOKENIZE_REGEX), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    qwen35 = gguf_tokenizer(byte_level_metadata("qwen35")).backend
    qwen2 = gguf_tokenizer(byte_level_metadata("qwen2")).backend
    text = "नमस्ते दुनिया, x\u0301y " + MIXED_TEXT  # Devanagari's vowel signs are marks
    assert qwen35.normalizer is not None
    normalized = qwen35.normalizer.normalize_str(text)
    assert qwen35.pre_tokenizer.pre_tokenize_str(normalized) == theirs.pre_tokenize_str(normalized)
    assert qwen2.pre_tokenizer.pre_tokenize_str(normalized) != theirs.pre_tokenize_str(normalized)


def test_unknown_pre_tokenizer_falls_back_to_gpt2_with_a_warning(caplog) -> None:
    with caplog.at_level("WARNING"):
        parts = gguf_tokenizer(byte_level_metadata("mystery-pre"))
    assert "mystery-pre" in caplog.text
    assert parts.backend.encode(" ab").ids == [7]


def test_sentencepiece_vocabulary_uses_scores_spaces_and_byte_fallback() -> None:
    tokens = ["<unk>", "<s>", "</s>", "<0x21>", "▁", "h", "i", "hi", "▁hi"]
    types = [2, TOKEN_CONTROL, TOKEN_CONTROL, TOKEN_BYTE] + [TOKEN_NORMAL] * 5
    metadata = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": [0.0, 0.0, 0.0, 0.0, -1.0, -2.0, -3.0, -0.5, -0.1],
        "tokenizer.ggml.token_type": types,
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
    }
    parts = gguf_tokenizer(metadata)
    ids = parts.backend.encode("hi hi!").ids
    assert ids == [8, 8, 3]  # "▁hi" twice (space prefix added), "!" through its byte token
    assert parts.backend.decode(ids) == "hi hi!"
    assert parts.add_bos_token is True and parts.bos_token == "<s>"


def test_unknown_tokenizer_kind_is_a_model_load_error() -> None:
    with pytest.raises(ModelLoadError, match="'bert'"):
        gguf_tokenizer({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})


def test_missing_vocabulary_is_a_model_load_error() -> None:
    with pytest.raises(ModelLoadError, match="no vocabulary"):
        gguf_tokenizer({"tokenizer.ggml.model": "gpt2"})
