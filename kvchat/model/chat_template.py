"""Rendering a model's Jinja chat template, as transformers does.

Chat templates come with model files and are untrusted code, so they run in
Jinja's immutable sandbox. The environment mirrors transformers'
`apply_chat_template` (trim_blocks, lstrip_blocks, loop controls, the
`raise_exception` and `strftime_now` globals, a `tojson` filter that does not
HTML-escape, the `{% generation %}` tag) so that a template renders the same
text here as in the model's reference implementation: the prompt the model was
trained on is the one it gets.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.utils
from jinja2.sandbox import ImmutableSandboxedEnvironment

from kvchat.errors import KvchatError

# One chat message as templates read it: {"role": ..., "content": ...}.
Message = Mapping[str, str]

# ChatML, for models that ship no template of their own.
DEFAULT_CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


class _TemplateRaised(Exception):
    """What `raise_exception` throws, so that render can tell it from a template bug."""


def _raise_exception(message: str) -> None:
    raise _TemplateRaised(message)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    # transformers replaces Jinja's filter: no HTML escaping, json.dumps options exposed.
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


class _TemplateDict:
    """`dict(...)` for templates without exposing the dict type itself (as transformers)."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict[Any, Any]:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """`namespace(...)` that refuses underscore names, as transformers' does."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # Jinja's signature trick
        self, rest = args[0], args[1:]
        attrs = dict(*rest, **kwargs)
        for name in attrs:
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore names on a namespace ({name!r})"
            )


class _GenerationTag(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: transformers marks assistant text with
    it for training masks; for rendering it just outputs its body."""

    tags = frozenset({"generation"})

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env


_ENV = _environment()


class ChatTemplate:
    """A compiled chat template with the model's BOS/EOS text bound in."""

    def __init__(self, source: str, *, bos_token: str | None, eos_token: str | None) -> None:
        try:
            self._template = _ENV.from_string(source)
        except jinja2.TemplateSyntaxError as error:
            raise KvchatError(
                f"The model's chat template has a syntax error at line {error.lineno}: "
                f"{error.message}. Fix the template (tokenizer_config.json or "
                "chat_template.jinja) or use a model with a valid one."
            ) from error
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token

    def render(
        self,
        messages: Sequence[Message],
        *,
        add_generation_prompt: bool,
        now: datetime | None = None,
    ) -> str:
        """Render `messages` to text; the generation prompt opens the assistant's turn.

        `now` pins what `strftime_now` returns, so that two renderings compared
        against each other (see `TurnRenderer`) cannot straddle midnight.
        """
        variables: dict[str, Any] = {
            "messages": [dict(message) for message in messages],
            "add_generation_prompt": add_generation_prompt,
            "bos_token": self.bos_token or "",
            "eos_token": self.eos_token or "",
            "tools": None,
            "documents": None,
        }
        if now is not None:
            variables["strftime_now"] = now.strftime
        try:
            return self._template.render(**variables)
        except _TemplateRaised as error:
            raise KvchatError(
                f"The model's chat template rejected the conversation: {error}"
            ) from error
        except Exception as error:  # anything a template does wrong is the template's fault
            raise KvchatError(
                "The model's chat template failed to render the conversation "
                f"({type(error).__name__}: {error}). "
                "The template may expect message fields kvchat does not send; "
                "fix the template or use another model."
            ) from error
