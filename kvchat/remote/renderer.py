"""`RemoteRenderer`: the session layer's `RendererPort` for a server that applies its own template.

The server renders and tokenizes the conversation itself; kvchat asks it for the
token ids of the templated messages only to size a turn (its context rule drops
the oldest third when the conversation would not fit). vLLM's `/tokenize` takes
the messages; llama-server renders them with `/apply-template` and tokenizes the
text with `/tokenize`. A server with neither gets an estimate of a token per 4
bytes of UTF-8, and its own 400 stays the last word on overflow. The ids are
never sent back: each turn sends messages, so there is no continuation to append
(`continuation_ids` is None and the session layer renders the whole turn).
"""

from __future__ import annotations

from collections.abc import Sequence

from kvchat.chat.engine_port import Message
from kvchat.remote.server import RemoteServer, ServerInfo

BYTES_PER_TOKEN = 4


class RemoteRenderer:
    renders_locally = False  # HTTP: turns are sized on the session layer's planner thread

    def __init__(self, server: RemoteServer, info: ServerInfo) -> None:
        self.server = server
        self.info = info
        self.exact = True  # False once a server offered no tokenizer and sizes are estimates

    def prompt_ids(self, messages: Sequence[Message]) -> list[int]:
        chat = [{"role": m["role"], "content": m["content"]} for m in messages]
        ids = self._tokenize(chat)
        if ids is not None:
            return ids
        self.exact = False
        size = sum(len(m["content"].encode()) + 8 for m in chat) // BYTES_PER_TOKEN + 1
        return [0] * size

    def continuation_ids(
        self,
        history: Sequence[Message],
        new_messages: Sequence[Message],
        *,
        reply_ended_with_stop: bool,
        stop_token_id: int | None = None,
    ) -> list[int] | None:
        return None

    def type_ahead_ids(
        self,
        history: Sequence[Message],
        user_text: str,
        *,
        reply_ended_with_stop: bool,
        stop_token_id: int | None = None,
    ) -> list[int] | None:
        """None: no type-ahead prefill on a server (it would cost a request per keystroke)."""
        return None

    def _tokenize(self, chat: list[dict[str, str]]) -> list[int] | None:
        server = self.server
        if self.info.kind in ("vllm", "sglang", "unknown"):
            body = {"model": self.info.model, "messages": chat, "add_generation_prompt": True}
            reply = server.post_json("/tokenize", body)
            if isinstance(reply, dict) and isinstance(reply.get("tokens"), list):
                return [int(t) for t in reply["tokens"]]
        if self.info.kind in ("llama-server", "unknown"):
            rendered = server.post_json("/apply-template", {"messages": chat})
            if isinstance(rendered, dict) and isinstance(rendered.get("prompt"), str):
                body = {"content": rendered["prompt"], "add_special": True, "parse_special": True}
                reply = server.post_json("/tokenize", body)
                if isinstance(reply, dict) and isinstance(reply.get("tokens"), list):
                    return [t if isinstance(t, int) else int(t["id"]) for t in reply["tokens"]]
        return None
