"""Where a follow-up's time goes: the step that prefills a few new tokens over a cached
history (switching back to a conversation), on an engine stepped by hand.

    python benchmarks/follow_up_profile.py [MODEL] [--history N] [--new N]

MODEL is a GGUF (a made shape's, `kvchat bench --list-shapes`), the default model if none.
A history of N tokens is prefilled and answered with one token, the engine's idle steps
run (as in a pause before the next message), then the same history with `--new` more
tokens comes back: its time to first token (every step until its first
token, the median of 10 rounds, each with new tokens of its own) and a `cProfile` of
those steps, top functions by own time.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

from kvchat.engine.config import EngineConfig
from kvchat.engine.engine import Engine
from kvchat.engine.events import RequestFinished
from kvchat.engine.request import GenerationRequest
from kvchat.model.loader import load_model
from kvchat.native import build


def first_token_s(engine: Engine, prompt: tuple[int, ...]) -> float:
    """Steps the engine until `prompt`'s one token is out; the seconds it took. Then the
    idle steps a pause before the next message gives the engine (defragmenting, faulting
    in the KV store), as the engine's thread runs them."""
    finished: list[RequestFinished] = []
    engine.submit(
        GenerationRequest(prompt, max_tokens=1, ignore_eos=True),
        lambda e: finished.append(e) if isinstance(e, RequestFinished) else None,
    )
    start = time.perf_counter()
    while not finished:
        engine.step()
    took = time.perf_counter() - start
    while engine.step():
        pass
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default=None)
    parser.add_argument("--history", type=int, default=2000)
    parser.add_argument("--new", type=int, default=35)
    args = parser.parse_args()
    build.request(wait=True)
    model = load_model(args.model)
    engine = Engine(model, EngineConfig(), start=False)
    history = tuple(1000 + i % 5000 for i in range(args.history))
    print(f"history of {args.history} tokens: {first_token_s(engine, history):.3f} s")
    times = []
    for round_ in range(10):
        new = tuple(7000 + 97 * round_ + i for i in range(args.new))
        times.append(first_token_s(engine, history + new))
    print(f"follow-up of {args.new} tokens: {statistics.median(times) * 1e3:.1f} ms (median of 10)")
    profile = cProfile.Profile()
    profile.enable()
    for round_ in range(10, 20):
        first_token_s(engine, history + tuple(7000 + 97 * round_ + i for i in range(args.new)))
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(12)
    engine.close()


if __name__ == "__main__":
    main()
