"""What defragmentation buys: decode steps over contiguous pages vs scattered ones.

A conversation whose pages are contiguous is read by attention as a plain slice of the
KV store (no copy); scattered pages need one gather per layer per step. This times a
batch-1 decode step of the default model at several context lengths both ways, and the
cost of `PageTable.defragment()` itself.

    python benchmarks/defrag.py
"""

from __future__ import annotations

import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvchat.engine.config import EngineConfig
from kvchat.engine.engine import Engine
from kvchat.model.batch import ForwardBatch
from kvchat.model.loader import load_model


def step_ms(engine: Engine, pages: list[int], context: int, n: int = 40) -> float:
    model = engine.transformer
    times = []
    for i in range(n + 5):
        batch = ForwardBatch.from_runs([[100 + i]], [context])
        start = time.perf_counter()
        engine.attention.prepare(batch, [pages])
        model.forward(batch, engine.attention)
        times.append(time.perf_counter() - start)
    times = sorted(times[5:])
    return 1e3 * times[len(times) // 2]


def main() -> None:
    model = load_model(None, dtype="bfloat16")
    config = EngineConfig(page_size=256, device_cache_bytes=1 << 30, host_cache_bytes=0)
    engine = Engine(model, config, start=False)
    total = engine.table.num_pages
    print("| context | contiguous pages (ms/step) | scattered pages (ms/step) | gain |")
    print("|---|---|---|---|")
    for context in (1024, 4096, 8000):
        used = context // 256 + 1
        contiguous = list(range(used))
        scattered = random.Random(0).sample(range(total), used)
        a = step_ms(engine, contiguous, context)
        b = step_ms(engine, scattered, context)
        print(f"| {context} | {a:.2f} | {b:.2f} | {100 * (b / a - 1):+.1f}% |")
    # the defragmentation pass itself: 24 conversations that grew in turns, interleaved,
    # so their pages alternate across the pool; then all of them finish
    table = engine.table
    rng = random.Random(1)
    chains = {i: [rng.randrange(3, 40000) for _ in range(4 * 256)] for i in range(24)}
    for i, ids in chains.items():
        table.reserve(i, ids[:256], count_as="prompt")
        table.commit(i, ids[:256])
    for turn in range(1, 4):
        for i, ids in chains.items():
            table.ensure_capacity(i, (turn + 1) * 256 + 1)
            table.commit(i, ids[turn * 256 : (turn + 1) * 256])
    for i in chains:
        table.release(i)
    start = time.perf_counter()
    moved = table.defragment()
    elapsed = 1e3 * (time.perf_counter() - start)
    table.validate()
    print(f"\ndefragment(): {moved} pages moved in {elapsed:.1f} ms")


if __name__ == "__main__":
    main()
