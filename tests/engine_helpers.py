"""Run requests through a real Engine and collect their events (tests only)."""

from __future__ import annotations

import threading

from kvchat.engine.config import EngineConfig
from kvchat.engine.engine import Engine
from kvchat.engine.events import RequestFinished, TypeAheadProgress
from kvchat.engine.request import GenerationRequest, SamplingParams


class Collector:
    """Collects one request's events; `wait()` returns its RequestFinished."""

    def __init__(self) -> None:
        self.events: list = []
        self.done = threading.Event()

    def __call__(self, event) -> None:
        self.events.append(event)
        if isinstance(event, RequestFinished):
            self.done.set()

    def wait(self, timeout: float = 120) -> RequestFinished:
        assert self.done.wait(timeout), "request did not finish"
        return self.events[-1]


def small_engine(model, **overrides) -> Engine:
    config = dict(device_cache_bytes=64 << 20, host_cache_bytes=64 << 20, page_size=16)
    config.update(overrides)
    return Engine(model, EngineConfig(**config))


def generate(model, ids, *, max_tokens: int, ignore_eos: bool = False, **engine_kw) -> list[int]:
    with small_engine(model, **engine_kw) as engine:
        c = Collector()
        engine.submit(
            GenerationRequest(tuple(ids), SamplingParams(), max_tokens, ignore_eos=ignore_eos), c
        )
        return list(c.wait().generated_ids)


class Progress:
    """A type-ahead's progress events; `wait_done()` blocks until it is computed."""

    def __init__(self) -> None:
        self.events: list[TypeAheadProgress] = []
        self.done = threading.Event()

    def __call__(self, event: TypeAheadProgress) -> None:
        self.events.append(event)
        if event.done:
            self.done.set()

    def wait_done(self, timeout: float = 60) -> TypeAheadProgress:
        assert self.done.wait(timeout), "the type-ahead was not computed"
        return self.events[-1]
