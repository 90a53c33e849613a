"""kvchat's own sessions on a remote server (`kvchat bench --engine URL`), as a chat peer.

The turns go through the same session layer as the TUI and `kvchat run` on that
server (`SessionService` over `kvchat.remote`), so W1, the sweep and W2 measure what a
user of `kvchat --engine URL` gets, beside the embedded engine in the same run.
The figures are the server's (`cached_tokens`); TTFT is from `say` to the first
streamed text; W2 says to all its sessions at once (`concurrent`), the server batching
them. A chat starts by asking the server to drop its prefix cache where
it offers a way (vLLM's dev-mode `/reset_prefix_cache`, llama-server's slot
erase); a server that offers none keeps what earlier repeats left in it, and the
report's description says which.
"""

from __future__ import annotations

import contextlib
import queue
import time
from collections.abc import Sequence

from kvchat.bench.peers.base import (
    BatchResult,
    PeerUnavailable,
    TurnResult,
    batch_from_deltas,
    concurrent_on_fresh_chat,
)
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

    def concurrent(self, questions: Sequence[str], tokens_each: int) -> BatchResult:
        """W2 through the server: one session per question, all said at once."""
        sids = [self.new_session() for _ in questions]
        deltas: dict[str, list[float]] = {sid: [] for sid in sids}
        generated: dict[str, int] = {}
        start = time.perf_counter()
        for sid, text in zip(sids, questions, strict=True):
            self.service.say(sid, text, sampling=GREEDY, max_tokens=tokens_each, ignore_eos=True)
        deadline = time.monotonic() + TURN_TIMEOUT_S
        while len(generated) < len(sids):
            try:
                event = self._events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise KvchatError("W2 on the server did not finish in time") from None
            sid = getattr(event, "session_id", None)
            if sid not in deltas:
                continue
            if isinstance(event, ReplyDelta):
                deltas[sid].append(time.perf_counter())
            elif isinstance(event, SessionFailed):
                raise KvchatError(f"kvchat could not start a W2 turn: {event.message}")
            elif isinstance(event, ReplyFinished):
                if event.stats.error is not None or not deltas[sid]:
                    raise KvchatError(f"kvchat failed a W2 turn: {event.stats.error}")
                generated[sid] = event.stats.generated_tokens
        return batch_from_deltas(
            [deltas[s] for s in sids], [generated[s] for s in sids], tokens_each, start
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

    def concurrent(
        self, questions: Sequence[str], tokens_each: int, capacity_tokens: int
    ) -> BatchResult:
        """W2 through the server: a fresh chat, one session per question, all said at once."""
        return concurrent_on_fresh_chat(self, questions, tokens_each, capacity_tokens)

    def peak_rss(self) -> None:
        """None: the server runs elsewhere, not started by the bench, so no figure of its
        memory is the bench's to give (and the bench's own process is not it)."""
        return None

    def close(self) -> None:
        """Nothing held between chats."""
