"""`run_tui(args)`: what `kvchat` (and `kvchat chat`) runs: settings, error log, the app.

Why here and not in the app: the command line's options and the settings file
are resolved into a `BackendFactory` for the real model; the app itself only
knows factories, so tests run it on a fake engine.
"""

from __future__ import annotations

import argparse
import functools
import sys
from dataclasses import replace
from types import MappingProxyType
from typing import TextIO

from kvchat.chat.error_log import configure_error_log
from kvchat.chat.settings import Settings, load_settings_checked
from kvchat.errors import UsageError
from kvchat.runtime import resolve_options
from kvchat.tui.app import KvchatApp
from kvchat.tui.backend import start_real_backend


def read_settings_for_tui() -> tuple[Settings, str | None]:
    """The settings' good values, and one message listing each bad key once (None when
    there is none)."""
    settings, problems = load_settings_checked()
    if not problems:
        return settings, None
    return settings, "\n".join(problems) + "\nTheir defaults are used; the file is left as it is."


def require_terminal(
    stdin: TextIO | None = None, stdout: TextIO | None = None, screen: TextIO | None = None
) -> None:
    """UsageError unless the keys come from a terminal and the UI can draw on one.

    Why: with no terminal, Textual keeps writing escape codes into a pipe or a file,
    a whole core busy for nothing. Textual draws on the standard error stream.
    """
    streams = {
        "standard input": stdin or sys.stdin,
        "standard output": stdout or sys.stdout,
        "standard error (where the UI draws)": screen or sys.__stderr__,
    }
    for name, stream in streams.items():
        try:
            is_terminal = stream is not None and stream.isatty()
        except (ValueError, OSError):  # closed
            is_terminal = False
        if not is_terminal:
            raise UsageError(
                f"the chat UI needs a terminal and {name} is not one; for scripts use "
                "`kvchat run SCRIPT` (JSON Lines, see kvchat run --help) or "
                '`kvchat ask "QUESTION"`'
            )


def with_theme_flag(settings: Settings, args: argparse.Namespace) -> Settings:
    """`--theme` over the settings file's theme, for this run (the file is not changed)."""
    theme = getattr(args, "theme", None)
    if not theme:
        return settings
    sources = MappingProxyType({**settings.sources, "theme": "--theme"})
    return replace(settings, theme=theme, sources=sources)


def run_tui(args: argparse.Namespace) -> int:
    """Open the TUI; returns the exit status (1 when kvchat could not start, or when
    messages could not be saved: the path of the file that holds them is printed;
    2 bad input)."""
    require_terminal()
    configure_error_log()
    settings, problem = read_settings_for_tui()
    settings = with_theme_flag(settings, args)
    resolve_options(args, settings)  # a bad flag is refused here, before the screen opens
    factory = functools.partial(start_real_backend, args, settings)
    app = KvchatApp(factory, settings=settings, settings_problem=problem)
    app.run()
    app.shutdown()
    if app.unsaved is not None:
        print(f"kvchat: {app.unsaved.summary()}", file=sys.stderr)
        if app.unsaved.path is None:
            sys.stderr.write(app.unsaved.text)
        return 1
    return app.return_code if app.return_code is not None else app.exit_code
