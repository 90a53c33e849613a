"""`guarded`: an action or handler that fails shows a notification, never a traceback.

A `KvchatError` (a user's mistake or a known failure) is shown as its message;
anything else is logged to the error log and reported in one line saying where.
Work done off the UI thread logs in its own `except` with `log_failure` and
notifies on the UI thread with `notify_failure` (or `notify_bug`, given only the
failure's text).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any, Protocol

from kvchat.chat.error_log import log_exception
from kvchat.errors import KvchatError
from kvchat.paths import app_paths


class Notifier(Protocol):
    """What shows the notification: the app, or a screen (which shows it through the app)."""

    def notify(self, message: str, *, severity: Any = ..., timeout: float | None = ...) -> None: ...


def log_failure(exc: Exception, what: str) -> None:
    """In an `except` block: log the traceback of anything but a `KvchatError`."""
    if not isinstance(exc, KvchatError):
        log_exception(f"TUI action {what} failed")


def notify_failure(app: Notifier, exc: Exception) -> None:
    """A `KvchatError`'s message, else one line saying where the details were logged."""
    if isinstance(exc, KvchatError):
        app.notify(str(exc), severity="error")
    else:
        notify_bug(app, str(exc))


def notify_bug(app: Notifier, what: str) -> None:
    """A failure that is not a `KvchatError` (its traceback is in the error log)."""
    app.notify(
        f"Something went wrong ({what}); details are in {app_paths().error_log}",
        severity="error",
    )


def guarded(method: Callable[..., Any]) -> Callable[..., Any]:
    """Show a `KvchatError` as a notification; log anything else and say where the log is."""

    def report(app: Notifier, exc: Exception) -> None:
        log_failure(exc, method.__name__)
        notify_failure(app, exc)

    if inspect.iscoroutinefunction(method):

        @functools.wraps(method)
        async def run_async(self: Notifier, *args: Any, **kwargs: Any) -> Any:
            try:
                return await method(self, *args, **kwargs)
            except Exception as exc:
                report(self, exc)
                return None

        return run_async

    @functools.wraps(method)
    def run(self: Notifier, *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except Exception as exc:
            report(self, exc)
            return None

    return run
