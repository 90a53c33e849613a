"""Search across sessions from the command palette: titles and messages, by what is typed.

A `Provider` beside the chat screen's commands: typing in the palette (ctrl+p) lists the
sessions whose title or messages hold the text; choosing one opens that session and
scrolls to the message. With nothing typed it lists nothing, so the palette still opens
on the commands.
"""

from __future__ import annotations

from functools import partial

from textual.command import Hit, Hits, Provider
from textual.content import Content

MAX_HITS = 30
_ROLES = {"user": "you", "assistant": "reply", "system": "system prompt"}


class SessionSearch(Provider):
    async def search(self, query: str) -> Hits:
        chat = getattr(self.app, "chat", None)  # the chat screen, once kvchat is serving
        if chat is None or len(query.strip()) < 2:
            return
        hits = chat.service.search(query, limit=MAX_HITS, include_archived=chat.show_archived)
        matcher = self.matcher(query)
        for rank, hit in enumerate(hits):
            label = f"{hit.number}. {hit.title}"
            if hit.message_id is None:
                display = Content.assemble("Go to ", matcher.highlight(label))
                help_text = "the session's title"
            else:
                display = Content(f"In {label}")
                help_text = f"{_ROLES.get(hit.role or '', hit.role)}: {hit.snippet}"
            # the palette sorts by score: keep the service's order (titles, then newest)
            score = 1.0 - rank / (2 * MAX_HITS)
            yield Hit(
                score, display, partial(chat.open_search_hit, hit), text=label, help=help_text
            )
