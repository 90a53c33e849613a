"""The session layer: conversations, their exact token ids, persistence, settings.

Must not import Textual or torch; talks to the engine only through
`engine_port.EnginePort` and renders turns through `engine_port.RendererPort`.
"""

from kvchat.chat.engine_port import ChatBackend, EnginePort, RendererPort, Residency
from kvchat.chat.error_log import configure_error_log, log_exception, paths_report
from kvchat.chat.service import SessionService
from kvchat.chat.settings import Settings, load_settings, save_setting
from kvchat.chat.store import Store

__all__ = [
    "ChatBackend",
    "EnginePort",
    "RendererPort",
    "Residency",
    "SessionService",
    "Settings",
    "Store",
    "configure_error_log",
    "load_settings",
    "log_exception",
    "paths_report",
    "save_setting",
]
