"""The meters panel: what the KV cache is doing, from `EngineStats` snapshots (docs/kv-cache.md).

Why from snapshots at most 4 times a second: `stats()` is an immutable snapshot
that is cheap to take, and counters only grow, so rates (evictions per second)
come from the difference of two snapshots; the UI never asks the engine thread
for anything that could wait on a step. A field repaints only when its text
changed, and lays the screen out only when its height did (`update_static`):
the UI thread's time is taken from the engine's (one GIL).
"""

from __future__ import annotations

from collections import deque

from textual.app import ComposeResult
from textual.containers import Vertical
from textual.content import Content
from textual.widgets import Label, Sparkline, Static

from kvchat.chat.session import SessionView, TurnState
from kvchat.engine.api import EngineStats, TierPages
from kvchat.tui.repaint import same_content, update_static
from kvchat.units import format_size

BAR_WIDTH = 14
SPARK_POINTS = 40
HELP = """Cache meters (right panel). "last turn" is the shown session's last finished
turn; while it has a reply on the way, its figures say "previous turn": they are of the
turn before that reply, which gets its own once it ends.
  Hit rate      the share of prompt tokens served from the KV cache instead of computed:
                for the shown session's last turn, and overall since kvchat started
                (overall counts a reply's prompt as soon as it is admitted)
  Pages         each tier's pages: ■ active (held by a running reply), □ cached (kept
                for reuse), · free; the figures below the bar are active/cached/free;
                "off" when the tier is turned off
  Evictions     pages pushed out since start: to host (device to host tier), to disk
                (to the disk tier), dropped (gone from every tier: computed again if
                needed); then the rate per second now, and its recent history as a
                sparkline
  TTFT          time to the first token of the shown session's last turn
  Decode tok/s  this reply: the shown session's reply as it streams (or "last turn":
                its last turn's rate); all: tokens a second of every session together,
                over the last few seconds, counted from when decoding began
  —             no figure yet (nothing measured since kvchat started)
Figures of turns from before this start are not shown: they would describe a cache
that no longer exists."""


ACTIVE, CACHED, FREE = "■", "□", "·"  # not the sidebar's █▓▒░, which mean tiers


def tier_bar(pages: TierPages | None, width: int = BAR_WIDTH) -> Content:
    """active / cached / free pages, proportional to the tier's capacity."""
    if pages is None or pages.capacity == 0:
        return Content.from_markup("[$text-muted]" + "·" * width)
    cap = pages.capacity
    active = min(width, round(width * pages.active / cap))
    if pages.active and not active:
        active = 1
    cached = min(width - active, round(width * pages.cached / cap))
    if pages.cached and not cached and active < width:
        cached = 1
    free = width - active - cached
    return Content.from_markup(
        f"[$accent]{ACTIVE * active}[/][$primary]{CACHED * cached}[/][$text-muted]{FREE * free}[/]"
    )


def _which_turn(view: SessionView | None) -> str:
    """What the last-turn figures are of: with a reply on the way, the turn before it."""
    return "previous turn" if view is not None and view.state != TurnState.IDLE else "last turn"


def _pct(value: float | None) -> str:
    return "—" if value is None else f"{value:.0%}"


def _rate(value: float | None) -> str:
    return "—" if value is None else f"{value:,.0f}"


class Meters(Vertical):
    """Hit rate, pages per tier, evictions, TTFT, decode speed."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.border_title = "Cache"
        self.previous: EngineStats | None = None
        self.eviction_rates: deque[float] = deque([0.0] * SPARK_POINTS, maxlen=SPARK_POINTS)
        self.values: dict[str, str] = {}  # label -> the text shown (tests read it)
        self._shown: dict[str, Content | str] = {}
        self._finished_here: set[str] = set()  # sessions with a turn finished in this run
        self._reply_rates: dict[str, str] = {}  # session -> its streaming rate last shown

    def compose(self) -> ComposeResult:
        self.fields = {
            name: Static(id=f"meter-{name}", classes="meter-value")
            for name in ("hit-rate", "pages", "evictions", "ttft", "decode")
        }
        self.fields["cache"] = Static(id="meter-cache", classes="meter-note")
        self.sparkline = Sparkline(list(self.eviction_rates), id="meter-eviction-rate")
        yield Label("Hit rate", classes="meter-label")
        yield self.fields["hit-rate"]
        yield Label(f"Pages {ACTIVE} active {CACHED} cached {FREE} free", classes="meter-label")
        yield self.fields["pages"]
        yield Label("Evictions", classes="meter-label")
        yield self.fields["evictions"]
        yield self.sparkline
        yield Label("TTFT", classes="meter-label")
        yield self.fields["ttft"]
        yield Label("Decode tok/s", classes="meter-label")
        yield self.fields["decode"]
        yield self.fields["cache"]

    def _set(self, name: str, content: Content | str) -> None:
        if name in self._shown and same_content(self._shown[name], content):
            return
        self._shown[name] = content
        self.values[name] = content.plain if isinstance(content, Content) else content
        update_static(self.fields[name], content)

    def turn_finished(self, session_id: str) -> None:
        """A turn of this session ended in this run: its last-turn figures are current."""
        self._finished_here.add(session_id)
        self._reply_rates.pop(session_id, None)

    def update_meters(
        self,
        stats: EngineStats,
        view: SessionView | None,
        session_rate: float | None,
    ) -> None:
        # a turn stored by an earlier run describes a cache that no longer exists
        fresh = view is not None and view.id in self._finished_here
        last = view.last_turn if view is not None and fresh else None
        last_hit = last.hit_rate if last is not None and last.prompt_tokens else None
        overall = stats.hit_rate if stats.cache.prompt_tokens else None
        not_reported = getattr(stats, "not_reported", "")  # a remote server without the figure
        if not_reported:
            self._set("hit-rate", not_reported)
        else:
            which = _which_turn(view)
            self._set("hit-rate", f"{which} {_pct(last_hit)}   overall {_pct(overall)}")
        if getattr(stats, "engine", None):  # a remote server: what its /metrics say
            self._set("pages", stats.pages_note)  # type: ignore[attr-defined]
            self._set("evictions", stats.evictions_note)  # type: ignore[attr-defined]
            self._set_speeds(stats, view, last, session_rate)
            return

        lines = []
        for tier, pages in stats.pages.items():
            counts = f"{pages.active}/{pages.cached}/{pages.free}" if pages.capacity else "off"
            if tier == "disk" and counts != "off":  # the folder is shared by every model
                used, cap = stats.disk_bytes.used, stats.disk_bytes.capacity
                counts += f"\n       {format_size(used)} of {format_size(cap)}"
            lines.append(Content.assemble(f"{tier:<6} ", tier_bar(pages), f"\n       {counts}"))
            window = getattr(stats, "window", None)
            if tier == "device" and window is not None:  # the windowed layers' slots
                counts = f"{window.active}/{window.cached}/{window.free}"
                lines.append(Content.assemble("window ", tier_bar(window), f"\n       {counts}"))
            kept = getattr(stats, "states_kept", 0)
            if tier == "device" and kept:  # a hybrid model's states at page ends
                size = format_size(getattr(stats, "state_bytes", 0))
                lines.append(Content(f"states {kept:,} kept ({size})"))
        self._set("pages", Content("\n").join(lines))

        ev = stats.cache.evictions
        dropped = ev.host_dropped + ev.device_dropped + ev.disk_dropped
        total = ev.device_to_host + ev.host_to_disk + dropped
        rate = 0.0
        if self.previous is not None and stats.time > self.previous.time:
            p = self.previous.cache.evictions
            before = p.device_to_host + p.host_to_disk + p.host_dropped + p.device_dropped
            before += p.disk_dropped
            rate = max(0.0, (total - before) / (stats.time - self.previous.time))
        if self.previous is None or stats.time != self.previous.time:
            self.eviction_rates.append(rate)
            self.sparkline.data = list(self.eviction_rates)
        self.previous = stats
        self._set(
            "evictions",
            f"{total:,} ({ev.device_to_host:,} to host, {ev.host_to_disk:,} to disk, "
            f"{dropped:,} dropped)  {rate:.1f}/s",
        )

        self._set_speeds(stats, view, last, session_rate)

    def _set_speeds(self, stats, view, last, session_rate: float | None) -> None:
        ttft = last.ttft_s if last is not None else None
        which = _which_turn(view)
        self._set("ttft", "—" if ttft is None else f"{which} {ttft * 1000:,.0f} ms")
        overall_rate = _rate(stats.decode_tok_s or None)  # 0: nothing decoded lately
        if view is not None and view.state == TurnState.IDLE:
            this = f"last turn {self._this_rate(view, session_rate)}"
        else:
            this = f"this reply {self._this_rate(view, session_rate)}"
        self._set("decode", f"{this}   all {overall_rate}")

    def _this_rate(self, view: SessionView | None, session_rate: float | None) -> str:
        """The shown session's rate: live while it streams (the last figure between two
        samples, its state before the first token), else its last turn's of this run."""
        if view is None:
            return "—"
        if view.state == TurnState.IDLE:
            last = view.last_turn if view.id in self._finished_here else None
            return _rate(last.decode_tok_s if last is not None else None)
        if session_rate is not None:
            self._reply_rates[view.id] = _rate(session_rate)
        elif view.state != TurnState.DECODING:
            return view.state  # queued, prefilling, preempted: no tokens yet
        return self._reply_rates.get(view.id, "starting")

    def set_cache_note(self, text: str) -> None:
        self._set("cache", text)
