"""`run_tui(args)`: what `kvchat` (and `kvchat chat`) runs: settings, error log, the app.

Why here and not in the app: the command line's options and the settings file
are resolved into a `BackendFactory` for the real model; the app itself only
knows factories, so tests run it on a fake engine.
"""

from __future__ import annotations

import argparse
import functools

from kvchat.chat.error_log import configure_error_log
from kvchat.chat.settings import Settings, load_settings
from kvchat.errors import KvchatError
from kvchat.tui.app import KvchatApp
from kvchat.tui.backend import start_real_backend


def read_settings_for_tui() -> tuple[Settings, str | None]:
    """The settings, or the defaults and a message saying why the file was not used."""
    try:
        return load_settings(), None
    except KvchatError as exc:
        return Settings(), f"{exc} Using the defaults; the file is left as it is."


def run_tui(args: argparse.Namespace) -> int:
    """Open the TUI; returns the exit status (1 when kvchat could not start)."""
    configure_error_log()
    settings, problem = read_settings_for_tui()
    factory = functools.partial(start_real_backend, args, settings)
    app = KvchatApp(factory, settings=settings, settings_problem=problem)
    app.run()
    app.shutdown()
    return app.return_code if app.return_code is not None else app.exit_code
