"""Streaming detokenization: deltas add up to the full decode and never split a character."""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from kvchat.model.detokenizer import IncrementalDetokenizer
from kvchat.model.tokenizer import Tokenizer
from tests.tiny_tokenizers import TRAINING_TEXT, build_tiny_tokenizer

TEXTS = {
    "emoji": "Done! 😀👍🏽 Great 🎉🇫🇷 job",
    "cjk": "你好，世界。日本語のテキストです。한국어",
    "code": 'def f(x):\n    return {"a": [x, 2]}  # comment\n\n\tprint(f(1))\n',
    "mixed": "  leading spaces, café naïve — “quotes” ∑ 1+1=2 ✓\n",
}


def _sentencepiece_like() -> BackendTokenizer:
    """A Llama-2 style tokenizer: Metaspace, byte fallback, a decoder that strips the
    first space. Decoding a token alone loses its leading space, so naive streaming
    would glue words together."""
    trained = BackendTokenizer(models.BPE())
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="first")
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"])
    trained.train_from_iterator([TRAINING_TEXT], trainer=trainer)
    spec = json.loads(trained.to_str())
    vocab = spec["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    spec["model"].update(byte_fallback=True, unk_token="<unk>")
    backend = BackendTokenizer.from_str(json.dumps(spec))
    backend.decoder = decoders.Sequence(
        [
            decoders.Replace("▁", " "),
            decoders.ByteFallback(),
            decoders.Fuse(),
            decoders.Strip(" ", 1, 0),
        ]
    )
    return backend


def _tokenizer(style: str) -> Tokenizer:
    if style == "sentencepiece":
        return Tokenizer(
            _sentencepiece_like(),
            bos_token="<s>",
            eos_token="</s>",
            add_bos_token=True,
            chat_template=None,
        )
    return Tokenizer(
        build_tiny_tokenizer(style),  # type: ignore[arg-type]
        bos_token=None,
        eos_token=None,
        add_bos_token=False,
        chat_template=None,
    )


STYLES = ["chatml", "llama3", "sentencepiece"]


def _stream(detok: IncrementalDetokenizer, ids: Sequence[int], chunk: int = 1) -> list[str]:
    deltas = [detok.push(ids[i : i + chunk]) for i in range(0, len(ids), chunk)]
    deltas.append(detok.flush())
    return deltas


@pytest.mark.parametrize("style", STYLES)
@pytest.mark.parametrize("name", list(TEXTS))
@pytest.mark.parametrize("chunk", [1, 3])
def test_deltas_add_up_to_the_full_decode_without_replacement_chars(
    style: str, name: str, chunk: int
) -> None:
    tok = _tokenizer(style)
    ids = tok.encode(TEXTS[name])
    expected = tok.decode(ids, skip_special=True)
    assert "\ufffd" not in expected
    deltas = _stream(IncrementalDetokenizer(tok), ids, chunk)
    assert "".join(deltas) == expected
    assert not any("\ufffd" in delta for delta in deltas)


@pytest.mark.parametrize("style", STYLES)
def test_the_texts_really_split_characters_across_tokens(style: str) -> None:
    """Guards the test above: a token-by-token decode of the emoji text is broken."""
    tok = _tokenizer(style)
    ids = tok.encode(TEXTS["emoji"])
    naive = [tok.decode([i]) for i in ids]
    assert any("\ufffd" in piece for piece in naive)


def test_leading_spaces_survive_a_decoder_that_strips_them() -> None:
    tok = _tokenizer("sentencepiece")
    ids = tok.encode("the cache keeps pages")
    assert "".join(tok.decode([i]) for i in ids) != "the cache keeps pages"
    assert "".join(_stream(IncrementalDetokenizer(tok), ids)) == "the cache keeps pages"


def test_text_is_emitted_as_soon_as_its_characters_are_complete() -> None:
    tok = _tokenizer("chatml")
    detok = IncrementalDetokenizer(tok)
    emoji_ids = tok.encode("😀")
    assert len(emoji_ids) > 1
    assert detok.push(tok.encode("Hi ")) == "Hi "
    assert [detok.push([i]) for i in emoji_ids[:-1]] == [""] * (len(emoji_ids) - 1)
    assert detok.push(emoji_ids[-1:]) == "😀"
    assert detok.flush() == ""


class _CountingTokenizer(Tokenizer):
    longest_decode = 0

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        self.longest_decode = max(self.longest_decode, len(ids))
        return super().decode(ids, skip_special)


def test_each_push_decodes_a_bounded_window_not_the_whole_stream() -> None:
    tok = _CountingTokenizer(
        build_tiny_tokenizer("chatml"),
        bos_token=None,
        eos_token=None,
        add_bos_token=False,
        chat_template=None,
    )
    ids = tok.encode(" ".join(TEXTS.values()) * 40)
    assert len(ids) > 2000
    tok.longest_decode = 0
    deltas = _stream(IncrementalDetokenizer(tok), ids)
    assert tok.longest_decode <= 16
    assert "".join(deltas) == Tokenizer.decode(tok, ids, skip_special=True)


def test_invalid_utf8_from_the_model_is_not_held_back_forever() -> None:
    tok = _tokenizer("chatml")
    continuation_bytes = tok.encode("😀")[1:]  # no lead byte: never a complete character
    ids = continuation_bytes * 10
    detok = IncrementalDetokenizer(tok)
    before_flush = "".join(detok.push([i]) for i in ids)
    assert before_flush  # emitted while streaming
    assert before_flush + detok.flush() == tok.decode(ids)


@pytest.mark.parametrize("skip_special", [True, False])
def test_special_tokens_are_skipped_unless_asked(skip_special: bool) -> None:
    tok = _tokenizer("chatml")
    ids = [*tok.encode("Bye."), tok.token_to_id("<|im_end|>")]
    text = "".join(_stream(IncrementalDetokenizer(tok, skip_special=skip_special), ids))
    assert text == ("Bye." if skip_special else "Bye.<|im_end|>")
