"""Loading a tokenizer from an HF folder, and what it says about special tokens."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvchat.errors import ModelLoadError
from kvchat.model.tokenizer import Tokenizer
from tests.tiny_tokenizers import (
    LLAMA3_CHAT_TEMPLATE,
    SMOLLM2_CHAT_TEMPLATE,
    TINY_VOCAB_SIZE,
    build_tiny_tokenizer,
    write_tiny_tokenizer,
)


@pytest.fixture
def chatml_folder(tmp_path: Path) -> Path:
    write_tiny_tokenizer(tmp_path, "chatml")
    return tmp_path


@pytest.fixture
def llama3_folder(tmp_path: Path) -> Path:
    write_tiny_tokenizer(tmp_path, "llama3")
    return tmp_path


def _edit_config(folder: Path, **changes: object) -> None:
    path = folder / "tokenizer_config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def test_tiny_tokenizer_has_the_advertised_vocab_size_and_is_deterministic() -> None:
    assert build_tiny_tokenizer("chatml").to_str() == build_tiny_tokenizer("chatml").to_str()
    for style in ("chatml", "llama3"):
        assert build_tiny_tokenizer(style).get_vocab_size() == TINY_VOCAB_SIZE <= 512


def test_chatml_folder_loads_special_tokens_and_template(chatml_folder: Path) -> None:
    tok = Tokenizer.from_folder(chatml_folder)
    assert tok.vocab_size == TINY_VOCAB_SIZE
    assert tok.bos_token_id == tok.token_to_id("<|im_start|>") == 1
    assert tok.eos_token_id == tok.token_to_id("<|im_end|>") == 2
    assert tok.add_bos_token is False
    assert tok.chat_template == SMOLLM2_CHAT_TEMPLATE
    assert tok.stop_token_ids == frozenset({2})


def test_llama3_folder_infers_bos_from_post_processor_and_stops_on_eot_and_eom(
    llama3_folder: Path,
) -> None:
    tok = Tokenizer.from_folder(llama3_folder)
    assert tok.add_bos_token is True  # no add_bos_token key: the post-processor adds BOS
    assert tok.bos_token_id == tok.token_to_id("<|begin_of_text|>")
    assert tok.eos_token_id == tok.token_to_id("<|eot_id|>")
    assert tok.stop_token_ids == frozenset(
        {tok.token_to_id("<|eot_id|>"), tok.token_to_id("<|eom_id|>")}
    )
    assert tok.chat_template == LLAMA3_CHAT_TEMPLATE


def test_missing_tokenizer_json_says_what_to_do(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match=r"no tokenizer\.json.*copy tokenizer\.json"):
        Tokenizer.from_folder(tmp_path)


def test_damaged_config_is_a_model_load_error(chatml_folder: Path) -> None:
    (chatml_folder / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match=r"tokenizer_config\.json"):
        Tokenizer.from_folder(chatml_folder)


def test_tokens_given_as_added_token_dicts_are_read(chatml_folder: Path) -> None:
    _edit_config(
        chatml_folder,
        bos_token={"content": "<|endoftext|>", "special": True},
        eos_token={"content": "<|im_end|>", "lstrip": False},
    )
    tok = Tokenizer.from_folder(chatml_folder)
    assert tok.bos_token == "<|endoftext|>"
    assert tok.bos_token_id == 0
    assert tok.eos_token_id == 2


def test_explicit_add_bos_token_wins(chatml_folder: Path) -> None:
    _edit_config(chatml_folder, add_bos_token=True)
    assert Tokenizer.from_folder(chatml_folder).add_bos_token is True


def test_list_of_named_templates_picks_default(chatml_folder: Path) -> None:
    _edit_config(
        chatml_folder,
        chat_template=[
            {"name": "tool_use", "template": "TOOLS"},
            {"name": "default", "template": "DEFAULT"},
        ],
    )
    assert Tokenizer.from_folder(chatml_folder).chat_template == "DEFAULT"


def test_chat_template_jinja_file_takes_precedence(chatml_folder: Path) -> None:
    (chatml_folder / "chat_template.jinja").write_text("FROM FILE")
    assert Tokenizer.from_folder(chatml_folder).chat_template == "FROM FILE"


@pytest.mark.parametrize("eos_ids", [0, [0, 2]])
def test_generation_config_eos_ids_become_stop_ids(chatml_folder: Path, eos_ids: object) -> None:
    (chatml_folder / "generation_config.json").write_text(json.dumps({"eos_token_id": eos_ids}))
    assert Tokenizer.from_folder(chatml_folder).stop_token_ids == frozenset({0, 2})


def test_encode_parses_special_tokens_only_when_asked(chatml_folder: Path) -> None:
    tok = Tokenizer.from_folder(chatml_folder)
    text = "<|im_start|>user\nhi<|im_end|>"
    with_special = tok.encode(text)
    assert with_special[0] == 1 and with_special[-1] == 2
    plain = tok.encode(text, special=False)
    assert 1 not in plain and 2 not in plain
    assert tok.decode(plain) == text


def test_encode_never_adds_bos_even_when_the_post_processor_would(llama3_folder: Path) -> None:
    tok = Tokenizer.from_folder(llama3_folder)
    ids = tok.encode("Hello world")
    assert tok.bos_token_id not in ids
    assert tok.decode(ids) == "Hello world"


def test_decode_round_trips_and_can_skip_special(chatml_folder: Path) -> None:
    tok = Tokenizer.from_folder(chatml_folder)
    text = "<|im_start|>assistant\nHé 😀 世界\tdef f(): return 1<|im_end|>\n"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert tok.decode(ids, skip_special=True) == "assistant\nHé 😀 世界\tdef f(): return 1\n"


def test_is_special_and_token_lookup(chatml_folder: Path) -> None:
    tok = Tokenizer.from_folder(chatml_folder)
    assert tok.is_special(2)
    assert not tok.is_special(tok.encode("a")[0])
    assert tok.id_to_token(2) == "<|im_end|>"
    assert tok.token_to_id("<|not a token|>") is None


def test_constructor_takes_parts_from_elsewhere() -> None:
    """The GGUF loader builds a Tokenizer from metadata through the constructor."""
    tok = Tokenizer(
        build_tiny_tokenizer("chatml"),
        bos_token="<|im_start|>",
        eos_token="<|endoftext|>",
        add_bos_token=False,
        chat_template=None,
        extra_stop_token_ids=[7],
    )
    # EOS, the extra id, and ChatML's end of turn.
    assert tok.stop_token_ids == frozenset({0, 2, 7})
    assert tok.chat_template is None
