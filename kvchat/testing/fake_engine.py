"""A fake engine and a character-level chat template for the chat, headless and TUI tests.

`FakeEngine` is a real thread emitting a deterministic schedule of engine events
for each submitted request, one token per request per step (so replies of
several sessions interleave as with continuous batching). It honours cancel,
counts cached tokens as the longest prefix shared with any sequence it has seen
(so prompt = cached + prefilled holds and hit rates look real), and reports
residency the same way. With `manual=True` a step runs only when the test calls
`advance()`, so a reply can be held mid-stream without sleeps.

`CharRenderer` renders a message as `<role>content` + END + newline, one token
per character (id = ord). Its continuation is exactly what a full render would
add, so tests can check "stored ids + continuation == full render".
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from kvchat.chat.engine_port import ChatBackend
from kvchat.engine.api import (
    CacheCounters,
    CachedTokens,
    EngineEvent,
    EngineStats,
    FinishReason,
    GenerationRequest,
    PrefillProgress,
    RequestFinished,
    RequestStarted,
    RequestState,
    Residency,
    TokenGenerated,
    TypeAheadProgress,
    common_prefix,
)

END = 3  # the stop token id of CharRenderer (rendered as nothing)


class CharRenderer:
    """One token per character; END closes every message."""

    stop_token_ids = frozenset({END})
    renders_locally = True

    def __init__(self, *, rewrites_history: bool = False) -> None:
        self.rewrites_history = rewrites_history  # True: continuation_ids returns None
        self.full_renders = 0

    @staticmethod
    def encode(text: str) -> list[int]:
        return [ord(c) for c in text]

    def _message(self, message: Mapping[str, str]) -> list[int]:
        return [*self.encode(f"<{message['role']}>{message['content']}"), END, ord("\n")]

    def prompt_ids(self, messages: Sequence[Mapping[str, str]]) -> list[int]:
        self.full_renders += 1
        out: list[int] = []
        for message in messages:
            out += self._message(message)
        return out + self.encode("<assistant>")

    def continuation_ids(
        self,
        history: Sequence[Mapping[str, str]],
        new_messages: Sequence[Mapping[str, str]],
        *,
        reply_ended_with_stop: bool,
        stop_token_id: int | None = None,
    ) -> list[int] | None:
        if self.rewrites_history:
            return None
        out = [] if reply_ended_with_stop else [END]
        out.append(ord("\n"))
        for message in new_messages:
            out += self._message(message)
        return out + self.encode("<assistant>")

    def type_ahead_ids(
        self,
        history: Sequence[Mapping[str, str]],
        user_text: str,
        *,
        reply_ended_with_stop: bool,
        stop_token_id: int | None = None,
    ) -> list[int] | None:
        if self.rewrites_history:
            return None
        user = self.encode(f"<user>{user_text}")
        if not history or history[-1]["role"] != "assistant":
            return [t for m in history for t in self._message(m)] + user
        return ([] if reply_ended_with_stop else [END]) + [ord("\n"), *user]


def default_reply(request: GenerationRequest, tokens: int) -> str:
    """Deterministic text from the prompt alone (same prompt, same reply)."""
    seed = sum(request.prompt_ids) % 997
    return f"r{len(request.prompt_ids)}-{seed} ".ljust(tokens, "x")[:tokens]


@dataclass
class _Live:
    request_id: int
    request: GenerationRequest
    on_event: Callable[[EngineEvent], None]
    plan: list[int]  # the reply's ids (before the stop token)
    started: bool = False
    generated: list[int] = field(default_factory=list)
    cancelled: bool = False
    cached: int = 0
    type_ahead_tokens: int = 0
    submit_time: float = 0.0
    first_token_time: float | None = None


class FakeEngine:
    """An `EnginePort` with a thread and a deterministic schedule; see the module docstring."""

    def __init__(
        self,
        *,
        tokens_per_reply: int = 8,
        context_length: int = 4096,
        fingerprint: str = "fake-model",
        manual: bool = False,
        reply_text: Callable[[GenerationRequest], str] | None = None,
        fail_submit: bool = False,
        error_after_tokens: int | None = None,
        error_from_request: int = 1,
        error_message: str = "fake engine failure",
        stall_after: Callable[[GenerationRequest], int | None] | None = None,
        encode: Callable[[str], Sequence[int]] | None = None,
        decode: Callable[[Sequence[int]], str] | None = None,
        stop_token_id: int = END,
    ) -> None:
        self.tokens_per_reply = tokens_per_reply
        self._context_length = context_length
        self._fingerprint = fingerprint
        self.manual = manual
        self.reply_text = reply_text
        self.fail_submit = fail_submit
        self.error_after_tokens = error_after_tokens  # requests from error_from_request fail
        self.error_from_request = error_from_request
        self.error_message = error_message
        self.stall_after = stall_after  # tokens after which a request waits for its cancel
        # a real tokenizer's encode/decode make the replies real ids (default: one char a token)
        self.encode = encode or (lambda text: [ord(c) for c in text])
        self.decode = decode or (lambda ids: "".join(chr(i) for i in ids))
        self.stop_token_id = stop_token_id
        self.submitted: list[GenerationRequest] = []
        self.prefetched: list[tuple[int, ...]] = []
        self.cancelled_ids: list[int] = []
        self.type_aheads: list[tuple[int, ...]] = []  # every type-ahead submitted, in order
        self.replaced_ids: list[int] = []  # type-aheads a later one replaced
        self._pending_type_aheads: dict[int, tuple[tuple[int, ...], Callable]] = {}
        # type-aheads computed (their tokens are cached)
        self._computed_type_aheads: list[tuple[int, ...]] = []
        self._seen: list[tuple[int, ...]] = []
        self._live: list[_Live] = []
        self._next_id = 1
        self._cond = threading.Condition()
        self._steps = threading.Semaphore(0)
        self._running = True
        self._totals = {"prompt": 0, "cached": 0, "prefilled": 0, "generated": 0}
        self._thread = threading.Thread(target=self._loop, name="fake-engine", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------ EnginePort

    @property
    def model_fingerprint(self) -> str:
        return self._fingerprint

    @property
    def context_length(self) -> int:
        return self._context_length

    def submit(self, request: GenerationRequest, on_event: Callable[[EngineEvent], None]) -> int:
        if self.fail_submit:
            raise RuntimeError("fake engine: submit failed")
        with self._cond:
            request_id = self._next_id
            self._next_id += 1
            text = (
                self.reply_text(request)
                if self.reply_text
                else default_reply(request, self.tokens_per_reply)
            )
            self.submitted.append(request)
            plan = list(self.encode(text)) or [ord("x")]
            self._live.append(
                _Live(request_id, request, on_event, plan, submit_time=time.monotonic())
            )
            self._cond.notify_all()
        return request_id

    def cancel(self, request_id: int) -> None:
        with self._cond:
            self.cancelled_ids.append(request_id)
            for live in self._live:
                if live.request_id == request_id:
                    live.cancelled = True
            self._pending_type_aheads.pop(request_id, None)
            self._cond.notify_all()

    def type_ahead(
        self,
        token_ids: Sequence[int],
        on_progress: Callable[[TypeAheadProgress], None],
        *,
        replaces: int | None = None,
    ) -> int:
        """A type-ahead is computed whole at the next step (unless cancelled first)."""
        with self._cond:
            if replaces is not None:
                self.replaced_ids.append(replaces)
                self._pending_type_aheads.pop(replaces, None)
            type_ahead_id = self._next_id
            self._next_id += 1
            self.type_aheads.append(tuple(token_ids))
            self._pending_type_aheads[type_ahead_id] = (tuple(token_ids), on_progress)
            self._cond.notify_all()
        return type_ahead_id

    def prefetch(self, token_ids: Sequence[int]) -> None:
        with self._cond:
            self.prefetched.append(tuple(token_ids))

    def residency(self, token_ids: Sequence[int]) -> Residency:
        with self._cond:
            device = max((common_prefix(token_ids, s) for s in self._seen), default=0)
        return Residency(device=device, host=0, nowhere=len(token_ids) - device)

    def stats(self) -> EngineStats:
        with self._cond:
            states: dict[str, int] = {}
            for live in self._live:
                state = RequestState.DECODING if live.started else RequestState.QUEUED
                states[str(state)] = states.get(str(state), 0) + 1
            t = dict(self._totals)
        return EngineStats(
            cache=CacheCounters(
                prompt_tokens=t["prompt"],
                cached_tokens=CachedTokens(device=t["cached"]),
                prefilled_tokens=t["prefilled"],
            ),
            generated_tokens=t["generated"],
            requests=states,
            page_size=16,
            time=time.monotonic(),
        )

    # ----------------------------------------------------------- test helpers

    def advance(self, steps: int = 1) -> None:
        """Manual mode: let `steps` more engine steps run."""
        for _ in range(steps):
            self._steps.release()

    def wait_until_idle(self, timeout: float = 10.0) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: not self._live, timeout)

    def close(self) -> None:
        with self._cond:
            self._running = False
            self._cond.notify_all()
        self._steps.release()
        self._thread.join(5)

    # ------------------------------------------------------------------ loop

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(
                    lambda: (
                        any(self._runnable(x) for x in self._live)
                        or bool(self._pending_type_aheads)
                        or not self._running
                    )
                )
                if not self._running:
                    return
            if self.manual:
                self._steps.acquire()
                if not self._running:
                    return
            self._step()

    def _runnable(self, live: _Live) -> bool:
        if live.cancelled or not live.started or self.stall_after is None:
            return True
        limit = self.stall_after(live.request)
        return limit is None or len(live.generated) < limit

    def _step(self) -> None:
        emit: list[tuple[Callable[[EngineEvent], None], EngineEvent]] = []
        with self._cond:
            for live in list(self._live):
                if self._runnable(live):
                    emit += self._advance_one(live)
            for type_ahead_id, (tokens, on_progress) in self._pending_type_aheads.items():
                self._seen.append(tokens)
                self._computed_type_aheads.append(tokens)
                n = len(tokens)
                emit.append((on_progress, TypeAheadProgress(type_ahead_id, n, n, time.monotonic())))
            self._pending_type_aheads.clear()
            self._cond.notify_all()
        for on_event, event in emit:
            on_event(event)

    def _advance_one(self, live: _Live) -> list[tuple[Callable[[EngineEvent], None], EngineEvent]]:
        now = time.monotonic()
        out: list[tuple[Callable[[EngineEvent], None], EngineEvent]] = []
        request = live.request
        if not live.started:
            live.started = True
            prompt = request.prompt_ids
            live.cached = max((common_prefix(prompt, s) for s in self._seen), default=0)
            live.cached = min(live.cached, len(prompt) - 1) if prompt else 0
            # served by type-aheads: what they matched beyond what turns had computed
            ahead = max((common_prefix(prompt, s) for s in self._computed_type_aheads), default=0)
            plain = [s for s in self._seen if s not in self._computed_type_aheads]
            turns = max((common_prefix(prompt, s) for s in plain), default=0)
            live.type_ahead_tokens = max(0, min(ahead, live.cached) - turns)
            self._seen.append(tuple(prompt))
            out.append((live.on_event, RequestStarted(live.request_id, now)))
            out.append(
                (live.on_event, PrefillProgress(live.request_id, len(prompt), len(prompt), now))
            )
        if live.cancelled:
            return [*out, self._finish(live, FinishReason.CANCELLED, now)]
        if (
            self.error_after_tokens is not None
            and live.request_id >= self.error_from_request
            and len(live.generated) >= self.error_after_tokens
        ):
            return [*out, self._finish(live, FinishReason.ERROR, now, self.error_message)]
        i = len(live.generated)
        room = self._context_length - len(request.prompt_ids)
        if i >= request.max_tokens or i >= room:
            return [*out, self._finish(live, FinishReason.LENGTH, now)]
        if i >= len(live.plan) and not request.ignore_eos:
            live.generated.append(self.stop_token_id)
            return [*out, self._finish(live, FinishReason.STOP, now)]
        token = live.plan[i % len(live.plan)]
        live.generated.append(token)
        live.first_token_time = live.first_token_time or now
        text = self.decode([token])
        out.append((live.on_event, TokenGenerated(live.request_id, text, (token,), now)))
        return out

    def _finish(
        self, live: _Live, reason: FinishReason, now: float, error: str | None = None
    ) -> tuple[Callable[[EngineEvent], None], EngineEvent]:
        self._live.remove(live)
        prompt = live.request.prompt_ids
        self._seen.append(tuple(prompt) + tuple(live.generated))
        self._totals["prompt"] += len(prompt)
        self._totals["cached"] += live.cached
        self._totals["prefilled"] += len(prompt) - live.cached
        self._totals["generated"] += len(live.generated)
        text = self.decode([t for t in live.generated if t != self.stop_token_id])
        ttft = None if live.first_token_time is None else live.first_token_time - live.submit_time
        event = RequestFinished(
            request_id=live.request_id,
            reason=reason,
            prompt_tokens=len(prompt),
            cached_tokens=CachedTokens(device=live.cached),
            prefilled_tokens=len(prompt) - live.cached,
            recomputed_tokens=0,
            generated_ids=tuple(live.generated),
            text=text,
            ttft_s=ttft,
            decode_tok_s=100.0 if live.generated else None,
            time=now,
            error=error,
            draft_tokens=live.type_ahead_tokens,
        )
        return (live.on_event, event)


def fake_backend(**engine_kwargs: object) -> ChatBackend:
    """A `ChatBackend` over a fresh `FakeEngine` and `CharRenderer`."""
    renderer = CharRenderer()
    return ChatBackend(
        engine=FakeEngine(**engine_kwargs),  # type: ignore[arg-type]
        renderer=renderer,
        stop_token_ids=renderer.stop_token_ids,
    )
