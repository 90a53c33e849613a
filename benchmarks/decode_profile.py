"""Where a 4-bit decode step's time goes, at ~512 tokens of context.

    python benchmarks/decode_profile.py [MODEL]

MODEL is a GGUF (a made shape's, `kvchat bench --list-shapes`), the default model if none.

One request decodes on an engine stepped by hand (no engine thread): the median step
and the median forward pass inside it over 100 steps, then a `cProfile` of 50 more
steps, its top functions by own time (the int4 products, the LM head, attention, ...).
"""

from __future__ import annotations

import cProfile
import pstats
import statistics
import sys
import time

from kvchat.engine.config import EngineConfig
from kvchat.engine.engine import Engine
from kvchat.engine.request import GenerationRequest
from kvchat.model.loader import load_model
from kvchat.native import build


def main() -> None:
    build.request(wait=True)
    model = load_model(sys.argv[1] if len(sys.argv) > 1 else None)
    engine = Engine(model, EngineConfig(), start=False)
    prompt = tuple(range(1000, 1512))
    engine.submit(GenerationRequest(prompt, max_tokens=100_000, ignore_eos=True), lambda e: None)
    for _ in range(5):
        engine.step()
    forwards: list[float] = []
    forward = engine.transformer.forward

    def timed_forward(*args, **kwargs):
        start = time.perf_counter()
        out = forward(*args, **kwargs)
        forwards.append(time.perf_counter() - start)
        return out

    engine.transformer.forward = timed_forward
    steps = []
    for _ in range(100):
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    step, fwd = statistics.median(steps) * 1e3, statistics.median(forwards) * 1e3
    print(f"attention: {build.summary(model.transformer.device)}")
    print(f"step {step:.2f} ms, forward {fwd:.2f} ms, engine around it {step - fwd:.2f} ms")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(50):
        engine.step()
    profile.disable()
    pstats.Stats(profile).sort_stats("tottime").print_stats(12)
    engine.close()


if __name__ == "__main__":
    main()
