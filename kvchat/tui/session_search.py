"""Search across sessions from the command palette: titles and messages, by what is typed.

A `Provider` beside the app's commands: typing in the palette (ctrl+p) lists the
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
        app = self.app
        service = getattr(app, "service", None)
        if service is None or len(query.strip()) < 2:
            return
        hits = service.search(
            query, limit=MAX_HITS, include_archived=getattr(app, "show_archived", False)
        )
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
            yield Hit(score, display, partial(app.open_search_hit, hit), text=label, help=help_text)
