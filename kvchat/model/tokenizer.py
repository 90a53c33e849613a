"""The model's tokenizer: text <-> ids, special tokens, and the ids that end a reply.

Wraps a `tokenizers.Tokenizer` (the Rust fast tokenizer every HF model ships as
`tokenizer.json`) together with what `tokenizer_config.json` and
`generation_config.json` add to it: which tokens are BOS and EOS, whether a BOS
is prepended, the chat template, and the ids that end generation. A GGUF loader
builds the same parts from the file's metadata and calls the constructor.

`encode` never adds a BOS on its own: the prompt builder (`TurnRenderer`) decides
that once per conversation, because a BOS in the middle of a session's stored ids
would be wrong and would break prefix matching in the KV cache.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import tokenizers

from kvchat.errors import ModelLoadError

# Tokens that end an assistant turn in common template families, stopped on when
# the vocabulary has them even if the config names another EOS: ChatML models
# (Qwen, SmolLM2) often declare `<|endoftext|>` as EOS but end turns with
# `<|im_end|>`; Llama 3 ends turns with `<|eot_id|>` and tool calls with `<|eom_id|>`.
_END_OF_TURN_TOKENS = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>")


class Tokenizer:
    """A fast tokenizer plus the special-token facts kvchat needs."""

    def __init__(
        self,
        backend: tokenizers.Tokenizer,
        *,
        bos_token: str | None,
        eos_token: str | None,
        add_bos_token: bool,
        chat_template: str | None,
        extra_stop_token_ids: Iterable[int] = (),
    ) -> None:
        self._backend = backend
        # A copy that treats special-token text as plain text, for `encode(special=False)`.
        # Built lazily; a copy rather than toggling the flag so encoding stays thread-safe.
        self._plain_backend: tokenizers.Tokenizer | None = None
        self._bos_token = bos_token
        self._eos_token = eos_token
        self._add_bos_token = add_bos_token
        self._chat_template = chat_template
        self._special_ids = frozenset(
            token_id
            for token_id, added in backend.get_added_tokens_decoder().items()
            if added.special
        )
        self._bos_token_id = self._id_or_none(bos_token)
        self._eos_token_id = self._id_or_none(eos_token)
        stops = set(extra_stop_token_ids)
        if self._eos_token_id is not None:
            stops.add(self._eos_token_id)
        for token in _END_OF_TURN_TOKENS:
            token_id = backend.token_to_id(token)
            if token_id is not None:
                stops.add(token_id)
        self._stop_token_ids = frozenset(stops)

    def _id_or_none(self, token: str | None) -> int | None:
        # Lenient on purpose: a config naming a token its vocabulary lacks (seen in
        # the wild for unused BOS tokens) should not stop a model from loading.
        return None if token is None else self._backend.token_to_id(token)

    # ------------------------------------------------------------------ loading

    @classmethod
    def from_folder(cls, path: str | Path) -> Tokenizer:
        """Load a Hugging Face model folder's tokenizer.

        Reads `tokenizer.json` (required), `tokenizer_config.json` (BOS/EOS,
        `add_bos_token`, `chat_template`), `special_tokens_map.json` as a fallback
        for BOS/EOS, `chat_template.jinja` (which wins over the config's template,
        as in transformers) and `generation_config.json`'s `eos_token_id`, whose
        ids become extra stop ids.
        """
        folder = Path(path)
        tokenizer_file = folder / "tokenizer.json"
        if not tokenizer_file.is_file():
            raise ModelLoadError(
                f"The model folder {folder} has no tokenizer.json. kvchat needs the fast "
                "tokenizer file: copy tokenizer.json from the model's original repository into "
                "the folder (or save it with transformers' AutoTokenizer.save_pretrained)."
            )
        try:
            backend = tokenizers.Tokenizer.from_file(str(tokenizer_file))
        except Exception as error:  # the Rust side raises plain Exception
            raise ModelLoadError(
                f"Could not read {tokenizer_file}: {error}. The file is damaged or from a "
                "tokenizers version too new for this one; re-download it or upgrade tokenizers."
            ) from error

        config = _read_json(folder / "tokenizer_config.json")
        special_map = _read_json(folder / "special_tokens_map.json")
        bos_token = _token_content(config.get("bos_token", special_map.get("bos_token")))
        eos_token = _token_content(config.get("eos_token", special_map.get("eos_token")))

        add_bos = config.get("add_bos_token")
        if not isinstance(add_bos, bool):
            # No explicit setting (Llama 3, Qwen): the BOS comes from the post-processor
            # when it adds one, so ask it and prepend it ourselves iff it would.
            add_bos = _post_processor_adds(backend, bos_token)

        chat_template = _pick_template(config.get("chat_template"))
        jinja_file = folder / "chat_template.jinja"
        if jinja_file.is_file():
            chat_template = jinja_file.read_text(encoding="utf-8")

        generation = _read_json(folder / "generation_config.json")
        extra_stops = generation.get("eos_token_id")
        if isinstance(extra_stops, int):
            extra_stops = [extra_stops]
        elif not isinstance(extra_stops, list):
            extra_stops = []

        return cls(
            backend,
            bos_token=bos_token,
            eos_token=eos_token,
            add_bos_token=add_bos,
            chat_template=chat_template,
            extra_stop_token_ids=[i for i in extra_stops if isinstance(i, int)],
        )

    # ------------------------------------------------------------------ text <-> ids

    def encode(self, text: str, *, special: bool = True) -> list[int]:
        """Tokenize `text`; never adds BOS or any other post-processor token.

        With `special=True` the text of special tokens (`<|im_start|>`) becomes
        their ids, as needed for rendered chat templates. With `special=False` it
        is tokenized as plain text, as needed for user-typed content that must not
        be able to forge a turn boundary.
        """
        backend = self._backend if special else self._plain()
        return backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        """Ids to text; bytes of an incomplete UTF-8 character come out as U+FFFD."""
        return self._backend.decode(list(ids), skip_special_tokens=skip_special)

    def _plain(self) -> tokenizers.Tokenizer:
        if self._plain_backend is None:
            plain = tokenizers.Tokenizer.from_str(self._backend.to_str())
            plain.encode_special_tokens = True
            self._plain_backend = plain
        return self._plain_backend

    # ------------------------------------------------------------------ facts

    @property
    def backend(self) -> tokenizers.Tokenizer:
        """The wrapped fast tokenizer (for callers that need its batch API)."""
        return self._backend

    @property
    def vocab_size(self) -> int:
        """Number of ids, added tokens included (the model's embedding may be larger)."""
        return self._backend.get_vocab_size(with_added_tokens=True)

    @property
    def bos_token(self) -> str | None:
        return self._bos_token

    @property
    def eos_token(self) -> str | None:
        return self._eos_token

    @property
    def bos_token_id(self) -> int | None:
        return self._bos_token_id

    @property
    def eos_token_id(self) -> int | None:
        return self._eos_token_id

    @property
    def stop_token_ids(self) -> frozenset[int]:
        """Ids that end a reply: EOS, generation_config's EOS ids, end-of-turn tokens."""
        return self._stop_token_ids

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @property
    def add_bos_token(self) -> bool:
        """Whether a prompt must start with the BOS id."""
        return self._add_bos_token

    def token_to_id(self, token: str) -> int | None:
        return self._backend.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    def is_special(self, token_id: int) -> bool:
        """True for ids of special added tokens (`<|im_end|>`), which decoding can skip."""
        return token_id in self._special_ids


def _read_json(path: Path) -> dict[str, Any]:
    """A JSON object from `path`, or {} when the file does not exist."""
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ModelLoadError(
            f"Could not read {path}: {error}. Fix or re-download the file."
        ) from error
    if not isinstance(data, dict):
        raise ModelLoadError(f"{path} should hold a JSON object; fix or re-download the file.")
    return data


def _token_content(value: object) -> str | None:
    """A special token from a config: a plain string or an AddedToken dict with "content"."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _pick_template(value: object) -> str | None:
    """The config's chat template: a string, or a list of named ones (take "default")."""
    if isinstance(value, str):
        return value
    if isinstance(value, list):
        named = {
            item.get("name"): item.get("template")
            for item in value
            if isinstance(item, dict) and isinstance(item.get("template"), str)
        }
        if "default" in named:
            return named["default"]
        if named:
            return next(iter(named.values()))
    return None


def _post_processor_adds(backend: tokenizers.Tokenizer, bos_token: str | None) -> bool:
    """Whether the tokenizer's post-processor puts `bos_token` in front of a text."""
    if bos_token is None:
        return False
    bos_id = backend.token_to_id(bos_token)
    ids = backend.encode("a", add_special_tokens=True).ids
    return bool(ids) and ids[0] == bos_id
