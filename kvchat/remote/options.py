"""Which engine a command runs on: the command line's `--engine`, then the settings file.

`--engine URL` (or `engine = "URL"` in the settings) selects a remote server;
`--engine embedded` overrides a server set in the settings file. With a server,
the embedded engine's flags make no sense: given on the command line they are
refused (exit 2, naming the flag); the same keys in the settings file are
ignored, so one settings file serves both.
"""

from __future__ import annotations

import argparse

from kvchat.chat.settings import Settings
from kvchat.remote.server import (
    DEFAULT_API_KEY_ENV,
    DEFAULT_SESSION_HEADER,
    RemoteOptions,
    server_root,
)

EMBEDDED = "embedded"
# flag -> argparse attribute: what only the embedded engine understands
EMBEDDED_ONLY_FLAGS = {
    "--model": "model",
    "--dtype": "dtype",
    "--weights": "weights",
    "--kv": "kv",
    "--device-cache": "device_cache",
    "--host-cache": "host_cache",
    "--disk-cache": "disk_cache",
    "--page-size": "page_size",
    "--quantize": "quantize",
    "--device": "device",
}


def remote_options(args: argparse.Namespace, settings: Settings) -> RemoteOptions | None:
    """The server to use, or None for the embedded engine. RemoteError for a bad URL."""
    engine = getattr(args, "engine", None) or settings.engine or EMBEDDED
    if engine.strip().lower() == EMBEDDED:
        return None
    server_root(engine)  # a bad URL fails here, before anything starts
    return RemoteOptions(
        url=engine,
        model=getattr(args, "remote_model", None) or settings.remote_model,
        api_key_env=getattr(args, "api_key_env", None)
        or settings.api_key_env
        or DEFAULT_API_KEY_ENV,
        session_header=getattr(args, "session_header", None)
        or settings.session_header
        or DEFAULT_SESSION_HEADER,
    )


def embedded_flag_given(args: argparse.Namespace) -> str | None:
    """The first embedded-only flag given on the command line, or None."""
    for flag, attr in EMBEDDED_ONLY_FLAGS.items():
        if getattr(args, attr, None) is not None:
            return flag
    return None
