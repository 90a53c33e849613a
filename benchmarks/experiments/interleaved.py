"""What the A/B scripts share: an engine decoding one request, stepped by hand, and
steps timed on two settings taken in turns, so the machine's drift hits both alike."""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable, Sequence

from kvchat.engine.config import EngineConfig
from kvchat.engine.engine import Engine
from kvchat.engine.request import GenerationRequest
from kvchat.model.loader import load_model
from kvchat.native import build


def ab_arguments(doc: str | None, *, rounds: int, steps: int) -> argparse.Namespace:
    """--context (prompt tokens before decoding), --rounds and --steps, from the command line."""
    parser = argparse.ArgumentParser(description=(doc or "").splitlines()[0])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=rounds)
    parser.add_argument("--steps", type=int, default=steps)
    return parser.parse_args()


def decoding_engine(context: int):
    """(model, engine): the default model, kvchat's kernels loaded, one request decoding
    after a `context`-token prompt, warmed up by five steps."""
    build.request(wait=True)
    model = load_model(None)
    engine = Engine(model, EngineConfig(), start=False)
    prompt = tuple(range(1000, 1000 + context))
    engine.submit(GenerationRequest(prompt, max_tokens=1 << 30, ignore_eos=True), lambda e: None)
    for _ in range(5):
        engine.step()
    return model, engine


def interleaved_medians(
    engine: Engine,
    sides: Sequence[str],
    switch: Callable[[str], None],
    *,
    rounds: int,
    steps: int,
) -> dict[str, float]:
    """Median step (ms) per side. Each round runs `steps` steps per side, the order
    alternating; `switch(side)` sets the engine up for a side, and one untimed step
    follows each switch."""
    times: dict[str, list[float]] = {side: [] for side in sides}
    for r in range(rounds):
        for side in sides if r % 2 == 0 else tuple(reversed(sides)):
            switch(side)
            engine.step()
            for _ in range(steps):
                start = time.perf_counter()
                engine.step()
                times[side].append(time.perf_counter() - start)
    return {side: statistics.median(t) * 1e3 for side, t in times.items()}
