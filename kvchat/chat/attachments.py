"""A file attached to a message: its text in a fenced block, or a clear error.

A message travels as one string (sent, stored as unsent text, edited again), and the
composer shows its attachments as chips: `split_message` finds the blocks at its start
again, so nothing is stored beside the text. `message_with(*split_message(m))` gives back
`m` for the text it wrote and for any text without a block at its start, and `m` up to
trailing whitespace for a message sent (stripped) with no text after its files.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from kvchat.errors import KvchatError

MAX_ATTACH_BYTES = 2_000_000


@dataclass(frozen=True)
class Attachment:
    """One attached file: its name and its block as the message carries it."""

    name: str
    block: str  # `attachment_text`'s output, ending in a newline


# a block as `attachment_text` writes it: its fence is longer than any run of backticks
# inside, so the first line that is the fence alone ends it
_BLOCK = re.compile(r"File `([^`\n]+)`:\n\n(`{3,})\n(?:.*?\n)?\2(?:\n|\Z)", re.DOTALL)


def attach(path: Path) -> Attachment:
    return Attachment(path.name, attachment_text(path))


def message_with(attachments: tuple[Attachment, ...], text: str) -> str:
    """The message: each attachment's block and a blank line, then the typed text."""
    return "".join(a.block + "\n" for a in attachments) + text


def split_message(message: str) -> tuple[tuple[Attachment, ...], str]:
    """The attachments a message starts with, and the text after them."""
    found: list[Attachment] = []
    rest = message
    while match := _BLOCK.match(rest):
        block = match.group(0)
        after = rest[match.end() :]
        if not block.endswith("\n"):  # the message ends with the block (sent, stripped)
            block += "\n"
        elif after.startswith("\n"):
            after = after[1:]
        elif after:  # text right after the fence, no blank line: not one of our blocks
            break
        found.append(Attachment(match.group(1), block))
        rest = after
    return tuple(found), rest


def attachment_text(path: Path) -> str:
    """A file's text as a fenced block for the message; KvchatError when it is not text."""
    try:
        size = path.stat().st_size
    except OSError as exc:
        raise KvchatError(f"cannot read {path}: {exc.strerror or exc}") from None
    if not path.is_file():
        raise KvchatError(f"{path} is not a file")
    if size > MAX_ATTACH_BYTES:
        raise KvchatError(f"{path} is {size:,} bytes; attach files under {MAX_ATTACH_BYTES:,}")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise KvchatError(f"{path} is not a UTF-8 text file") from None
    except OSError as exc:
        raise KvchatError(f"cannot read {path}: {exc.strerror or exc}") from None
    fence = "```"
    while fence in text:
        fence += "`"
    return f"File `{path.name}`:\n\n{fence}\n{text.rstrip()}\n{fence}\n"
