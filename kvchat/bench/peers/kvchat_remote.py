"""kvchat's own sessions on a remote server (`kvchat bench --engine URL`), as a chat peer.

The turns go through the same session layer as the TUI and `kvchat run` on that
server (`SessionService` over `kvchat.remote`), so W1 and the sweep measure what a
user of `kvchat --engine URL` gets, beside the embedded engine in the same run.
The figures are the server's (`cached_tokens`); TTFT is from `say` to the first
streamed text. A chat starts by asking the server to drop its prefix cache where
it offers a way (vLLM's dev-mode `/reset_prefix_cache`, llama-server's slot
erase); a server that offers none keeps what earlier repeats left in it, and the
report's description says which.
"""

from __future__ import annotations

import contextlib
import queue
import time

from kvchat.bench.peers.base import PeerUnavailable, TurnResult
from kvchat.chat.events import ReplyDelta, ReplyFinished, SessionFailed
from kvchat.chat.service import SessionService
from kvchat.chat.store import Store
from kvchat.engine.api import SamplingParams
from kvchat.errors import KvchatError
from kvchat.remote import RemoteOptions, open_remote_backend

GREEDY = SamplingParams(temperature=0.0)
TURN_TIMEOUT_S = 1800.0


class KvchatRemoteChat:
    def __init__(self, options: RemoteOptions) -> None:
        backend = open_remote_backend(options)
        self.engine = backend.engine
        self.service = SessionService(
            backend.engine, backend.renderer, Store.in_memory(), default_sampling=GREEDY
        )
        self._events: queue.Queue = queue.Queue()
        self.service.subscribe(self._events.put)
        self._seen: dict[str, int] = {}  # session -> previous prompt + reply, in tokens

    def new_session(self) -> str:
        return self.service.create_session("bench")

    def turn(self, session: object, text: str, max_tokens: int) -> TurnResult:
        sid = str(session)
        start = time.perf_counter()
        self.service.say(sid, text, sampling=GREEDY, max_tokens=max_tokens, ignore_eos=True)
        first: float | None = None
        deadline = time.monotonic() + TURN_TIMEOUT_S
        while True:
            try:
                event = self._events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise KvchatError("a bench turn on the server did not finish in time") from None
            if isinstance(event, ReplyDelta) and event.session_id == sid and first is None:
                first = time.perf_counter()
            elif isinstance(event, SessionFailed) and event.session_id == sid:
                raise KvchatError(f"kvchat could not start a bench turn: {event.message}")
            elif isinstance(event, ReplyFinished) and event.session_id == sid:
                break
        end = time.perf_counter()
        stats = event.stats
        if stats.error is not None or first is None:
            raise KvchatError(f"kvchat failed a bench turn: {stats.error or 'no token came'}")
        prefilled = stats.prefilled_tokens
        new = stats.prompt_tokens - self._seen.get(sid, 0)
        self._seen[sid] = stats.prompt_tokens + stats.generated_tokens
        return TurnResult(
            ttft_s=first - start,
            total_s=end - start,
            prompt_tokens=stats.prompt_tokens,
            prefilled_tokens=stats.prompt_tokens if prefilled is None else prefilled,
            new_tokens=max(0, new),
            generated_tokens=stats.generated_tokens,
            engine_ttft_s=stats.ttft_s,
            text=event.text,
        )

    def close(self) -> None:
        self.service.close()
        self.engine.close()


class KvchatRemotePeer:
    """`kvchat bench --engine URL`: kvchat's sessions on that server."""

    def __init__(self, options: RemoteOptions, progress) -> None:
        self.options = options
        try:
            probe = KvchatRemoteChat(options)
        except KvchatError as exc:
            raise PeerUnavailable(str(exc)) from None
        info = probe.engine.info
        probe.close()
        self.name = f"kvchat@{info.kind}"
        self.description = f"kvchat's sessions on {info.name} at {probe.engine.server.root}"
        progress(f"kvchat bench: {self.description}, model {info.model}")

    def chat(self, capacity_tokens: int) -> KvchatRemoteChat:
        chat = KvchatRemoteChat(self.options)
        server = chat.engine.server
        with contextlib.suppress(Exception):  # a fresh cache where the server offers one
            if chat.engine.info.kind == "vllm":
                server.http.post("/reset_prefix_cache")
            elif chat.engine.info.kind == "llama-server":
                slots = server.get_json("/slots") or []
                for slot in slots if isinstance(slots, list) else []:
                    server.http.post(f"/slots/{slot.get('id', 0)}", params={"action": "erase"})
        return chat

    def close(self) -> None:
        """Nothing held between chats."""
