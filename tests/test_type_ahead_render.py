"""A type-ahead renders exactly as its turn would, up to the end of the user's text.

The submitted turn must extend the type-ahead's ids, so the pages the type-ahead computed
are the turn's own prefix; only a word still growing at the type-ahead's end may
tokenize differently, and only there may the ids differ.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

import pytest

from kvchat.model.chat_template import ChatTemplate
from kvchat.model.tokenizer import Tokenizer
from kvchat.model.turn_renderer import TurnRenderer
from tests.tiny_tokenizers import STRIP_THINKING_TEMPLATE, write_tiny_tokenizer

DOCUMENT = "```python\ndef double(x):\n    return x * 2\n```"
QUESTION = "What does this function return for 21?"


def _renderer(tmp_path: Path, style: Literal["chatml", "llama3"]) -> TurnRenderer:
    write_tiny_tokenizer(tmp_path, style)
    tokenizer = Tokenizer.from_folder(tmp_path)
    assert tokenizer.chat_template is not None
    template = ChatTemplate(
        tokenizer.chat_template, bos_token=tokenizer.bos_token, eos_token=tokenizer.eos_token
    )
    return TurnRenderer(tokenizer, template)


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("style", ["chatml", "llama3"])
def test_first_turn_type_ahead_is_a_prefix_of_the_turns_prompt(
    tmp_path: Path, style: Literal["chatml", "llama3"]
) -> None:
    renderer = _renderer(tmp_path, style)
    text = f"{DOCUMENT}\n\n{QUESTION}"
    ahead = renderer.type_ahead_ids([], text, reply_ended_with_stop=False)
    turn = renderer.prompt_ids([{"role": "user", "content": text}])
    assert ahead is not None and len(ahead) < len(turn)
    assert turn[: len(ahead)] == ahead
    assert renderer.tokenizer.decode(ahead).endswith(QUESTION)


@pytest.mark.parametrize("style", ["chatml", "llama3"])
def test_follow_up_type_ahead_is_a_prefix_of_the_continuation(
    tmp_path: Path, style: Literal["chatml", "llama3"]
) -> None:
    renderer = _renderer(tmp_path, style)
    history = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
    ]
    ahead = renderer.type_ahead_ids(history, QUESTION, reply_ended_with_stop=True)
    cont = renderer.continuation_ids(
        history, [{"role": "user", "content": QUESTION}], reply_ended_with_stop=True
    )
    assert ahead is not None and cont is not None
    assert cont[: len(ahead)] == ahead and len(cont) > len(ahead)


def test_a_growing_type_ahead_differs_only_in_its_last_tokens(tmp_path: Path) -> None:
    renderer = _renderer(tmp_path, "chatml")
    full = f"{DOCUMENT}\n\n{QUESTION}"
    turn = renderer.prompt_ids([{"role": "user", "content": full}])
    for cut in range(len(DOCUMENT), len(full)):
        ahead = renderer.type_ahead_ids([], full[:cut], reply_ended_with_stop=False)
        assert ahead is not None
        # the text typed so far is the turn's, except at most its last word
        assert _common(ahead, turn) >= len(ahead) - 3


def test_a_template_that_rewrites_history_gives_no_type_ahead(tmp_path: Path) -> None:
    write_tiny_tokenizer(tmp_path, "chatml")
    tok = Tokenizer.from_folder(tmp_path)
    renderer = TurnRenderer(
        tok, ChatTemplate(STRIP_THINKING_TEMPLATE, bos_token=None, eos_token=None)
    )
    history = [
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "<think>easy</think>4"},
    ]
    assert renderer.type_ahead_ids(history, "3+3?", reply_ended_with_stop=True) is None
