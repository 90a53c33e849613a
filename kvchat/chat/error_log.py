"""The error log: tracebacks go to a rotating file under the user log folder, never the screen.

Users see a one-line message; the log keeps what a bug report needs. Both
`kvchat.*` loggers and `log_exception` write there once `configure_error_log`
has run (the CLI calls it at start).
"""

from __future__ import annotations

import logging
import logging.handlers
from pathlib import Path

from kvchat.paths import app_paths

_LOGGER = logging.getLogger("kvchat")
_HANDLER_NAME = "kvchat-error-log"


def configure_error_log(path: Path | None = None, level: int = logging.WARNING) -> Path:
    """Attach the rotating file handler (once per path: a process that moves its kvchat
    folder, as tests do, logs to the new one); returns the log file's path."""
    path = path or app_paths().error_log
    for handler in list(_LOGGER.handlers):
        if handler.get_name() == _HANDLER_NAME:
            if Path(handler.baseFilename) == path.absolute():
                return path
            _LOGGER.removeHandler(handler)
            handler.close()
    path.parent.mkdir(parents=True, exist_ok=True)
    handler = logging.handlers.RotatingFileHandler(
        path, maxBytes=1_000_000, backupCount=3, encoding="utf-8", delay=True
    )
    handler.set_name(_HANDLER_NAME)
    handler.setFormatter(
        logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(threadName)s] %(message)s")
    )
    _LOGGER.addHandler(handler)
    _LOGGER.setLevel(min(level, _LOGGER.level or level))
    _LOGGER.propagate = False  # never onto the terminal
    return path


def log_exception(message: str) -> None:
    """Log `message` with the current exception's traceback (call inside `except`)."""
    _LOGGER.error(message, exc_info=True)


def paths_report() -> str:
    """What `kvchat paths` prints: every file and folder kvchat uses, one a line."""
    paths = app_paths()
    rows = [
        ("data", paths.data_dir),
        ("database", paths.database),
        ("config", paths.config_dir),
        ("settings", paths.settings_file),
        ("themes", paths.themes_dir),
        ("cache", paths.cache_dir),
        ("models", paths.models_dir),
        ("kv cache", paths.kv_cache_dir),
        ("log", paths.error_log),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(f"{name.ljust(width)}  {value}" for name, value in rows)
