"""Building a `tokenizers.Tokenizer` from the vocabulary stored in a GGUF file.

A GGUF has no tokenizer.json: it stores the tokens, the merges (or scores),
each token's type, the special ids and a pre-tokenizer *name*
(`tokenizer.ggml.pre`), and llama.cpp maps that name to split rules compiled
into it. We rebuild the equivalent Hugging Face tokenizer, choosing for each
name the pre-tokenizer the model was trained with (its original
tokenizer.json), because the prompt's token ids must be the ones the weights
expect and the ones the session stores for prefix caching.

Two vocabulary kinds (`tokenizer.ggml.model`):
- `gpt2`: byte-level BPE from tokens and merges (SmolLM2, Llama 3, Qwen2).
- `llama`: SentencePiece-style BPE with scores, byte fallback and "▁" for
  spaces (Llama 2, Mistral, TinyLlama).

Tokens typed CONTROL (`<|im_start|>`, `<|endoftext|>`) become special added
tokens and USER_DEFINED ones plain added tokens, so each encodes as one id
instead of being split into pieces.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import cache

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

from kvchat.errors import ModelLoadError

log = logging.getLogger(__name__)

# llama.cpp's `llama_token_type` values.
TOKEN_NORMAL = 1
TOKEN_UNKNOWN = 2
TOKEN_CONTROL = 3
TOKEN_USER_DEFINED = 4
TOKEN_UNUSED = 5
TOKEN_BYTE = 6

# The split regexes of the original tokenizer.json files.
LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen3.5's: Qwen2's, with combining marks (\p{M}) kept with the letters they follow
QWEN35_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}"
    r"| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

_LLAMA3_NAMES = frozenset({"llama3", "llama-v3", "llama-bpe", "smaug-bpe", "dbrx"})
_QWEN2_NAMES = frozenset({"qwen2", "deepseek-r1-qwen"})
# llama.cpp's pre-tokenizer names whose split is a regex, then byte-level
_SPLITS = {
    **dict.fromkeys(_LLAMA3_NAMES, LLAMA3_SPLIT),
    **dict.fromkeys(_QWEN2_NAMES, QWEN2_SPLIT),
    "qwen35": QWEN35_SPLIT,
}
_GPT2_NAMES = frozenset({"gpt2", "default"})


@dataclass(frozen=True)
class GGUFTokenizerParts:
    """What kvchat's `Tokenizer` needs, read from a GGUF.

    `backend` adds no BOS by itself; the caller adds `bos_token` when
    `add_bos_token` is true, as llama.cpp does.
    """

    backend: Tokenizer
    bos_token: str | None
    eos_token: str | None
    add_bos_token: bool
    chat_template: str | None
    eos_token_id: int | None


@cache
def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map from bytes to printable characters (as in tokenizers' ByteLevel)."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    chars = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars), strict=True))


def _list(metadata: dict[str, object], key: str) -> list:
    value = metadata.get(key)
    if value is None:
        return []
    if not isinstance(value, list):
        raise ModelLoadError(f"the GGUF's {key!r} is not a list; the file is corrupt.")
    return value


def _byte_level_pre_tokenizer(pre: str | None) -> pre_tokenizers.PreTokenizer:
    if pre == "smollm":
        # SmolLM/SmolLM2's own tokenizer.json: every digit alone, then GPT-2's split.
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Digits(individual_digits=True),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
            ]
        )
    split = _SPLITS.get(pre) if isinstance(pre, str) else None
    if split is not None:
        return pre_tokenizers.Sequence(
            [
                pre_tokenizers.Split(Regex(split), behavior="isolated"),
                pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
            ]
        )
    if pre not in _GPT2_NAMES:
        log.warning(
            "GGUF pre-tokenizer %r is unknown to kvchat; using GPT-2's split, "
            "so some texts may tokenize differently from the original model.",
            pre,
        )
    return pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)


def _byte_level(metadata: dict[str, object], tokens: list[str]) -> Tokenizer:
    merges = _list(metadata, "tokenizer.ggml.merges")
    if not merges:
        raise ModelLoadError("the GGUF's byte-level vocabulary has no merges; the file is corrupt.")
    alphabet = set(_bytes_to_unicode().values())
    spelling = _bytes_to_unicode()
    # A token outside the byte alphabet (a user-defined one written with raw
    # spaces, say) is looked up in its byte-level spelling, as transformers does.
    vocab = {
        (tok if set(tok) <= alphabet else "".join(spelling[b] for b in tok.encode("utf-8"))): i
        for i, tok in enumerate(tokens)
    }
    pre = metadata.get("tokenizer.ggml.pre")
    try:
        bpe = models.BPE(
            vocab=vocab,
            merges=[tuple(m.split(" ", 1)) for m in merges],
            # Llama 3's tokenizer.json looks a whole word up before merging.
            ignore_merges=pre in _LLAMA3_NAMES,
        )
    except Exception as exc:  # tokenizers raises a bare Exception for a bad vocabulary
        raise ModelLoadError(
            f"the GGUF's tokenizer is inconsistent ({exc}); the file is corrupt."
        ) from exc
    backend = Tokenizer(bpe)
    if pre in _QWEN2_NAMES or pre == "qwen35":  # Qwen's tokenizer.json normalize to NFC
        backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = _byte_level_pre_tokenizer(pre if isinstance(pre, str) else None)
    backend.decoder = decoders.ByteLevel()
    return backend


def _sentencepiece_merges(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """Merges implied by a SentencePiece BPE vocabulary: every split of a token into two
    tokens, ranked by the merged token's score (higher first), as transformers derives them."""
    vocab = {tok: i for i, tok in enumerate(tokens)}
    found: list[tuple[float, int, int, str, str]] = []
    for tok, score in zip(tokens, scores, strict=False):
        for cut in range(1, len(tok)):
            left, right = tok[:cut], tok[cut:]
            if left in vocab and right in vocab:
                found.append((-score, vocab[left], vocab[right], left, right))
    found.sort()
    return [(left, right) for _, _, _, left, right in found]


def _sentencepiece(metadata: dict[str, object], tokens: list[str]) -> Tokenizer:
    scores = [float(s) for s in _list(metadata, "tokenizer.ggml.scores")]
    merges = _list(metadata, "tokenizer.ggml.merges")
    merge_pairs = (
        [tuple(m.split(" ", 1)) for m in merges]
        if merges
        else _sentencepiece_merges(tokens, scores or [0.0] * len(tokens))
    )
    unk_id = metadata.get("tokenizer.ggml.unknown_token_id")
    unk = tokens[unk_id] if isinstance(unk_id, int) and 0 <= unk_id < len(tokens) else None
    bpe = models.BPE(
        vocab={tok: i for i, tok in enumerate(tokens)},
        merges=merge_pairs,
        unk_token=unk,
        fuse_unk=True,
        byte_fallback=True,
    )
    backend = Tokenizer(bpe)
    steps = [normalizers.Replace(" ", "▁")]
    if metadata.get("tokenizer.ggml.add_space_prefix", True):
        steps.insert(0, normalizers.Prepend("▁"))
    backend.normalizer = normalizers.Sequence(steps)
    decode_steps = [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    if metadata.get("tokenizer.ggml.add_space_prefix", True):
        decode_steps.append(decoders.Strip(" ", 1, 0))
    backend.decoder = decoders.Sequence(decode_steps)
    return backend


def _add_typed_tokens(
    backend: Tokenizer, tokens: list[str], types: list[int], byte_level: bool
) -> None:
    """Register CONTROL tokens as special and USER_DEFINED ones as added, so they stay whole."""
    alphabet = set(_bytes_to_unicode().values()) if byte_level else None
    vocab = backend.get_vocab()
    special, added = [], []
    for tok, kind in zip(tokens, types, strict=False):
        if kind == TOKEN_CONTROL:
            # A byte-level "control" token outside the byte alphabet is a llama.cpp
            # mislabel; adding it would grow the vocabulary past the model's.
            if alphabet is None or set(tok) <= alphabet:
                special.append(AddedToken(tok, special=True, normalized=False))
        elif kind == TOKEN_USER_DEFINED and tok in vocab:
            added.append(AddedToken(tok, special=False, normalized=False))
    if special:
        backend.add_special_tokens(special)
    if added:
        backend.add_tokens(added)


def gguf_tokenizer(metadata: dict[str, object]) -> GGUFTokenizerParts:
    """Build the tokenizer a GGUF's metadata describes."""
    kind = metadata.get("tokenizer.ggml.model")
    tokens = _list(metadata, "tokenizer.ggml.tokens")
    if not tokens:
        raise ModelLoadError(
            "the GGUF carries no vocabulary (tokenizer.ggml.tokens); kvchat cannot tokenize for it."
        )
    if kind == "gpt2":
        backend = _byte_level(metadata, tokens)
    elif kind == "llama":
        backend = _sentencepiece(metadata, tokens)
    else:
        raise ModelLoadError(
            f"the GGUF's tokenizer is of kind {kind!r}; kvchat builds 'gpt2' (byte-level BPE) "
            "and 'llama' (SentencePiece BPE) tokenizers."
        )
    types = [int(t) for t in _list(metadata, "tokenizer.ggml.token_type")]
    _add_typed_tokens(backend, tokens, types, byte_level=kind == "gpt2")

    def token(key: str) -> tuple[str | None, int | None]:
        index = metadata.get(key)
        if isinstance(index, int) and 0 <= index < len(tokens):
            return tokens[index], index
        return None, None

    bos, _ = token("tokenizer.ggml.bos_token_id")
    eos, eos_id = token("tokenizer.ggml.eos_token_id")
    # llama.cpp adds BOS to SentencePiece vocabularies unless told otherwise.
    add_bos = metadata.get("tokenizer.ggml.add_bos_token", kind == "llama")
    template = metadata.get("tokenizer.chat_template")
    return GGUFTokenizerParts(
        backend=backend,
        bos_token=bos,
        eos_token=eos,
        add_bos_token=bool(add_bos) and bos is not None,
        chat_template=template if isinstance(template, str) else None,
        eos_token_id=eos_id,
    )


tokenizer_parts_from_gguf = gguf_tokenizer
"""Alias under the name kvchat's loader imports."""
