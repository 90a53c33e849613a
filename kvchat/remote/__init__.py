"""Remote engines: kvchat's sessions on an OpenAI-compatible server (vLLM, SGLang, llama-server).

`open_remote_backend` connects to the server and returns the `ChatBackend` the
session layer, the TUI, `run` and `ask` use in place of the embedded engine.
"""

from __future__ import annotations

from kvchat.chat.engine_port import ChatBackend
from kvchat.remote.engine import RemoteEngine, RemoteStats
from kvchat.remote.renderer import RemoteRenderer
from kvchat.remote.server import RemoteError, RemoteOptions, RemoteServer, server_root

__all__ = [
    "RemoteEngine",
    "RemoteError",
    "RemoteOptions",
    "RemoteRenderer",
    "RemoteServer",
    "RemoteStats",
    "open_remote_backend",
    "server_root",
]


def open_remote_backend(options: RemoteOptions) -> ChatBackend:
    """Connect (models, kind, context, cached-token probe); RemoteError with what to do."""
    server = RemoteServer(options)
    try:
        engine = RemoteEngine.connect(server, options.model)
    except BaseException:
        server.close()
        raise
    return ChatBackend(engine, RemoteRenderer(server, engine.info), frozenset())
