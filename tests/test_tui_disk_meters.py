"""The disk tier in the TUI: the cache panel's pages and evictions, the sidebar's residency."""

from __future__ import annotations

from dataclasses import replace

from textual.app import App, ComposeResult

from kvchat.chat.engine_port import Residency
from kvchat.engine.api import CacheCounters, EngineStats, Evictions, PerTier, TierPages
from kvchat.engine.stats import DiskBytes
from kvchat.tui.meters import Meters
from kvchat.tui.sidebar import bar_cells, residency_bar


class MetersApp(App):
    def compose(self) -> ComposeResult:
        yield Meters(id="meters")


def stats(disk: TierPages, used: int, capacity: int) -> EngineStats:
    return EngineStats(
        cache=CacheCounters(
            evictions=Evictions(
                device_to_host=7, host_dropped=1, device_dropped=2, host_to_disk=5, disk_dropped=3
            )
        ),
        pages=PerTier(TierPages(10, 2, 3, 5), TierPages(20, 0, 20, 0), disk),
        disk_bytes=DiskBytes(capacity, used),
        time=1.0,
    )


async def test_the_cache_panel_shows_the_disk_tier_and_its_evictions() -> None:
    app = MetersApp()
    async with app.run_test() as pilot:
        meters = app.query_one(Meters)
        meters.update_meters(stats(TierPages(100, 0, 40, 60), 300 << 20, 8 << 30), None, None)
        await pilot.pause()
        pages = meters.values["pages"]
        assert "disk" in pages and "0/40/60" in pages and "300.0MiB of 8.0GiB" in pages
        assert "5 to disk" in meters.values["evictions"]
        assert meters.values["evictions"].startswith("18 (7 to host, 5 to disk, 6 dropped)")
        meters.update_meters(stats(TierPages(), 0, 0), None, None)
        await pilot.pause()
        assert meters.values["pages"].rstrip().endswith("off")  # the tier turned off


async def test_the_cache_panel_shows_the_window_slots_of_a_windowed_model() -> None:
    app = MetersApp()
    async with app.run_test() as pilot:
        meters = app.query_one(Meters)
        windowed = replace(stats(TierPages(), 0, 0), window=TierPages(8, 3, 4, 1))
        meters.update_meters(windowed, None, None)
        await pilot.pause()
        lines = meters.values["pages"].splitlines()
        at = next(i for i, line in enumerate(lines) if line.startswith("window"))
        assert lines[at - 2].startswith("device") and lines[at + 1].strip() == "3/4/1"
        meters.update_meters(stats(TierPages(), 0, 0), None, None)
        await pilot.pause()
        assert "window" not in meters.values["pages"]  # a model without windowed layers


def test_the_residency_bar_shows_tokens_only_on_disk() -> None:
    r = Residency(device=400, host=200, nowhere=200, disk=800)
    assert bar_cells(r, 16) == (4, 2, 8, 2)
    assert residency_bar(r, 16).plain == "████▓▓▒▒▒▒▒▒▒▒░░"
    assert bar_cells(Residency(device=10, host=0, nowhere=6), 16) == (10, 0, 0, 6)


async def test_the_cache_panel_shows_a_hybrid_models_kept_states() -> None:
    app = MetersApp()
    async with app.run_test() as pilot:
        meters = app.query_one(Meters)
        meters.update_meters(
            replace(stats(TierPages(), 0, 0), states_kept=3, state_bytes=3 << 20), None, None
        )
        await pilot.pause()
        assert "states 3 kept (3.0MiB)" in meters.values["pages"]
