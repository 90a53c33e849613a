"""Appending turns to stored ids gives exactly what rendering the whole conversation gives.

Templates that rewrite earlier turns (e.g. strip reasoning from assistant turns
once they are no longer last) cannot be appended to: `continuation_ids` returns
None for them and the caller falls back to `prompt_ids` of the whole
conversation, whose common prefix with the stored ids the KV cache still reuses.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import pytest

from kvchat.model.chat_template import DEFAULT_CHATML_TEMPLATE, ChatTemplate
from kvchat.model.tokenizer import Tokenizer
from kvchat.model.turn_renderer import TurnRenderer
from tests.tiny_tokenizers import (
    SMOLLM2_CHAT_TEMPLATE,
    STRIP_THINKING_TEMPLATE,
    build_tiny_tokenizer,
    write_tiny_tokenizer,
)

END_OF_TURN = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>"}

USER_TURNS = [
    "Summarize this code:\n```python\ndef f(x):\n    return x * 2\n```",
    "Name one function defined in that code.",
    "Translate 'hello' to Chinese and add an emoji.",
    "Is there any error handling in it? Answer briefly.",
]
REPLIES = [
    "It defines `f`, which doubles its argument.",
    "`f(x)` is the only one.",
    "你好 👋😀",
    "No, there is none.\n\n- no `try`\n- no checks",
]


def _renderer(tmp_path: Path, style: Literal["chatml", "llama3"]) -> TurnRenderer:
    write_tiny_tokenizer(tmp_path, style)
    tokenizer = Tokenizer.from_folder(tmp_path)
    assert tokenizer.chat_template is not None
    template = ChatTemplate(
        tokenizer.chat_template, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token
    )
    return TurnRenderer(tokenizer, template)


@pytest.mark.parametrize("style", ["chatml", "llama3"])
@pytest.mark.parametrize("system", [None, "You are terse."])
@pytest.mark.parametrize("ended_with_stop", [True, False])
def test_appending_turns_equals_rendering_the_whole_conversation(
    tmp_path: Path,
    style: Literal["chatml", "llama3"],
    system: str | None,
    ended_with_stop: bool,
) -> None:
    renderer = _renderer(tmp_path, style)
    tok = renderer.tokenizer
    end_id = tok.token_to_id(END_OF_TURN[style])
    messages: list[dict[str, str]] = (
        [] if system is None else [{"role": "system", "content": system}]
    )
    stored: list[int] = []
    for user_text, reply_text in zip(USER_TURNS, REPLIES, strict=True):
        user = {"role": "user", "content": user_text}
        appended = renderer.continuation_ids(
            messages, [user], reply_ended_with_stop=ended_with_stop
        )
        assert appended is not None
        stored += appended
        messages.append(user)
        assert stored == renderer.prompt_ids(messages)
        # The model "generates" the tokenization of the reply, then its end of turn.
        stored += tok.encode(reply_text, special=False)
        if ended_with_stop:
            stored.append(end_id)
        messages.append({"role": "assistant", "content": reply_text})
    assert len(messages) == 8 + (system is not None)


def test_prompt_ends_with_the_generation_prompt_and_has_one_bos(tmp_path: Path) -> None:
    renderer = _renderer(tmp_path, "llama3")
    tok = renderer.tokenizer
    ids = renderer.prompt_ids([{"role": "user", "content": "Hi"}])
    assert ids.count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id
    assert tok.decode(ids).endswith("<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_bos_is_prepended_when_the_template_does_not_write_it() -> None:
    tok = Tokenizer(
        build_tiny_tokenizer("chatml"),
        bos_token="<|endoftext|>",
        eos_token="<|im_end|>",
        add_bos_token=True,
        chat_template=None,
    )
    template = ChatTemplate(DEFAULT_CHATML_TEMPLATE, bos_token="<|endoftext|>", eos_token=None)
    ids = TurnRenderer(tok, template).prompt_ids([{"role": "user", "content": "Hi"}])
    assert ids[:2] == [0, tok.token_to_id("<|im_start|>")]


def test_chatml_prompt_has_no_bos_and_gets_smollm2_default_system_prompt(tmp_path: Path) -> None:
    renderer = _renderer(tmp_path, "chatml")
    ids = renderer.prompt_ids([{"role": "user", "content": "Hi"}])
    assert renderer.tokenizer.decode(ids).startswith(
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM"
    )
    assert ids[0] == renderer.tokenizer.token_to_id("<|im_start|>")


def test_explicit_stop_token_id_is_used_and_a_foreign_one_gives_none(tmp_path: Path) -> None:
    renderer = _renderer(tmp_path, "chatml")
    tok = renderer.tokenizer
    history = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
    ]
    new = [{"role": "user", "content": "Bye"}]
    stored = renderer.prompt_ids(history[:1]) + tok.encode("Hello!")
    im_end = tok.token_to_id("<|im_end|>")
    appended = renderer.continuation_ids(
        history, new, reply_ended_with_stop=True, stop_token_id=im_end
    )
    assert appended is not None
    assert [*stored, im_end, *appended] == renderer.prompt_ids(history + new)
    # The model stopped on <|endoftext|>, which the template never writes there.
    endoftext = tok.token_to_id("<|endoftext|>")
    assert (
        renderer.continuation_ids(history, new, reply_ended_with_stop=True, stop_token_id=endoftext)
        is None
    )


def test_template_that_strips_earlier_reasoning_cannot_be_appended(tmp_path: Path) -> None:
    write_tiny_tokenizer(tmp_path, "chatml")
    tok = Tokenizer.from_folder(tmp_path)
    template = ChatTemplate(STRIP_THINKING_TEMPLATE, bos_token=None, eos_token=None)
    renderer = TurnRenderer(tok, template)
    history = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>easy</think>4"},
    ]
    new = [{"role": "user", "content": "3+3?"}]
    assert renderer.continuation_ids(history, new, reply_ended_with_stop=True) is None
    # Without reasoning the same template appends fine.
    plain = [history[0], {"role": "assistant", "content": "4"}]
    assert renderer.continuation_ids(plain, new, reply_ended_with_stop=True) is not None


def test_reply_the_template_trims_cannot_be_appended(tmp_path: Path) -> None:
    renderer = _renderer(tmp_path, "llama3")  # Llama 3 trims every message's content
    history = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!\n"},
    ]
    new = [{"role": "user", "content": "Bye"}]
    assert renderer.continuation_ids(history, new, reply_ended_with_stop=True) is None


@pytest.mark.real_model
def test_smollm2_template_constant_is_the_real_models(default_gguf_path: Path) -> None:
    gguf = pytest.importorskip("gguf")
    reader = gguf.GGUFReader(str(default_gguf_path))
    assert reader.fields["tokenizer.chat_template"].contents() == SMOLLM2_CHAT_TEMPLATE
