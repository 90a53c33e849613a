"""Chat templates render as transformers renders them, and fail with a clear message."""

from __future__ import annotations

from datetime import datetime

import pytest

from kvchat.errors import KvchatError
from kvchat.model.chat_template import DEFAULT_CHATML_TEMPLATE, ChatTemplate
from tests.tiny_tokenizers import LLAMA3_CHAT_TEMPLATE, SMOLLM2_CHAT_TEMPLATE

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is <b>2+2</b>? Répondez « vite » 😀"},
    {"role": "assistant", "content": "  4  "},
    {"role": "user", "content": "And 3+3?"},
]

# Exercises what transformers' environment adds: trim/lstrip blocks, loop controls,
# namespace, the tojson filter (no HTML escaping, non-ASCII kept), the generation tag.
FEATURE_TEMPLATE = """\
{% set ns = namespace(count=0) %}
{% for message in messages %}
    {% if message['role'] == 'system' %}{% continue %}{% endif %}
    {% set ns.count = ns.count + 1 %}
    {% if message['role'] == 'assistant' %}
[{{ ns.count }}] A: {% generation %}{{ message['content'] }}{% endgeneration %}
    {% else %}
[{{ ns.count }}] {{ message | tojson }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}A:{% endif %}"""


def _transformers_render(source: str, messages: list[dict[str, str]], gen: bool) -> str:
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(
        conversations=[messages],
        chat_template=source,
        add_generation_prompt=gen,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
    )
    return rendered[0]


@pytest.mark.parametrize(
    "source",
    [SMOLLM2_CHAT_TEMPLATE, LLAMA3_CHAT_TEMPLATE, FEATURE_TEMPLATE, DEFAULT_CHATML_TEMPLATE],
)
@pytest.mark.parametrize("gen", [True, False])
def test_renders_exactly_as_transformers(source: str, gen: bool) -> None:
    template = ChatTemplate(source, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>")
    rendered = template.render(CONVERSATION, add_generation_prompt=gen)
    assert rendered == _transformers_render(source, CONVERSATION, gen)


def test_smollm2_template_inserts_default_system_prompt() -> None:
    template = ChatTemplate(SMOLLM2_CHAT_TEMPLATE, bos_token="<|im_start|>", eos_token="<|im_end|>")
    rendered = template.render([{"role": "user", "content": "Hi"}], add_generation_prompt=True)
    assert rendered == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
        "Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_default_chatml_template() -> None:
    template = ChatTemplate(DEFAULT_CHATML_TEMPLATE, bos_token=None, eos_token=None)
    rendered = template.render([{"role": "user", "content": "Hi"}], add_generation_prompt=False)
    assert rendered == "<|im_start|>user\nHi<|im_end|>\n"


def test_tojson_keeps_html_and_non_ascii() -> None:
    template = ChatTemplate("{{ messages[0] | tojson }}", bos_token=None, eos_token=None)
    rendered = template.render(
        [{"role": "user", "content": "<b>é</b>"}], add_generation_prompt=False
    )
    assert rendered == '{"role": "user", "content": "<b>é</b>"}'


def test_syntax_error_is_reported_at_construction_with_its_line() -> None:
    with pytest.raises(KvchatError, match="syntax error at line 2"):
        ChatTemplate("ok\n{% for m in messages %}", bos_token=None, eos_token=None)


def test_raise_exception_becomes_a_kvchat_error_with_the_templates_message() -> None:
    template = ChatTemplate(
        "{% if messages[0]['role'] != 'user' %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant') }}{% endif %}",
        bos_token=None,
        eos_token=None,
    )
    with pytest.raises(KvchatError, match="rejected the conversation: Conversation roles must"):
        template.render([{"role": "assistant", "content": "x"}], add_generation_prompt=False)


def test_template_cannot_mutate_its_inputs() -> None:
    template = ChatTemplate("{{ messages.append(1) }}", bos_token=None, eos_token=None)
    with pytest.raises(KvchatError, match="failed to render"):
        template.render([], add_generation_prompt=False)


def test_strftime_now_can_be_pinned() -> None:
    template = ChatTemplate("{{ strftime_now('%d %b %Y') }}", bos_token=None, eos_token=None)
    pinned = datetime(2024, 7, 26, 23, 59)
    assert template.render([], add_generation_prompt=False, now=pinned) == "26 Jul 2024"
    before = datetime.now().strftime("%d %b %Y")
    unpinned = template.render([], add_generation_prompt=False)
    assert unpinned in {before, datetime.now().strftime("%d %b %Y")}


def test_bos_and_eos_text_are_template_variables() -> None:
    template = ChatTemplate("{{ bos_token }}|{{ eos_token }}", bos_token="<s>", eos_token="</s>")
    assert template.render([], add_generation_prompt=False) == "<s>|</s>"
