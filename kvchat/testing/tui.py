"""Driving the TUI in tests and benchmarks: an app over the fake engine, waits on conditions.

`wait_until` awaits `pilot.pause()` in a loop until the condition holds; it
never sleeps a fixed time, so a test is as fast as the app and fails with a
message (not a hang) when the condition never comes (oterm's rule).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

from kvchat.chat.settings import Settings
from kvchat.chat.store import Store
from kvchat.engine.api import SamplingParams
from kvchat.testing.fake_engine import FakeEngine, fake_backend
from kvchat.tui.app import KvchatApp
from kvchat.tui.backend import ModelChoice, TuiBackend


async def wait_until(
    pilot, condition: Callable[[], bool], timeout: float = 10.0, what: str = ""
) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what or condition}")
        await pilot.pause()


def fake_app(
    *,
    settings: Settings | None = None,
    store: Store | None = None,
    user_themes_dir: Path | None = None,
    settings_problem: str | None = None,
    describe: Callable[[], str] | None = None,
    loaded: threading.Event | None = None,
    notices: tuple[str, ...] = (),
    models: Callable[[], tuple[ModelChoice, ...]] = tuple,
    switch: Callable[[str, Callable[[str], None]], TuiBackend] | None = None,
    model_name: str = "",
    has_model: Callable[[str], bool] = lambda _name: True,
    **engine_kwargs: object,
) -> tuple[KvchatApp, FakeEngine]:
    """A `KvchatApp` over a `FakeEngine` (returned for `advance()` in manual mode).

    With `loaded`, the "model" finishes loading only when the test sets it.
    """
    chat = fake_backend(**engine_kwargs)
    engine = chat.engine
    assert isinstance(engine, FakeEngine)
    backend = TuiBackend(
        chat=chat,
        default_sampling=SamplingParams(),
        default_max_tokens=64,
        description="fake engine",
        describe=describe,
        close=engine.close,
        notices=notices,
        models=models,
        switch=switch,
        model_name=model_name,
        has_model=has_model,
    )

    def load(progress: Callable[[str], None]) -> TuiBackend:
        if loaded is not None and not loaded.wait(30):
            raise AssertionError("the test never let the model finish loading")
        return backend

    app = KvchatApp(
        load,
        settings=settings,
        settings_problem=settings_problem,
        store_factory=(lambda: store) if store is not None else Store.in_memory,
        user_themes_dir=user_themes_dir,
    )
    return app, engine


async def ready(pilot, app: KvchatApp) -> None:
    await wait_until(
        pilot,
        lambda: app.chat is not None and app.chat.serving and app.focused is app.chat.composer,
        20,
        "start-up to end",
    )


async def new_sessions(pilot, app: KvchatApp, count: int) -> list[str]:
    """`count` new sessions, each current in turn, made the way ctrl+n makes one when no
    empty session is listed (the key itself reuses an empty one, so pressing it twice
    does not make two). Returns their ids in creation order."""
    made = []
    for _ in range(count):
        made.append(await app.chat.open_new_session())
        await pilot.pause()
    return made
