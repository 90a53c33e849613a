"""A 4-bit decode step with the weights in 2 MiB pages (as kvchat places them) against
the same weights in ordinary 4 KiB pages, interleaved in one process.

    python benchmarks/huge_pages_ab.py [--context 512] [--rounds 8] [--steps 30]

One request decodes on an engine stepped by hand; each round runs `--steps` steps on
each placement, alternating which goes first, by swapping every linear layer's tensors
between the huge-page arena the model built and plain copies of them. Prints each side's
median step and the process's AnonHugePages (0 kB means the OS granted no huge pages:
THP off, and the A/B compares like with like).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from kvchat.engine.config import EngineConfig
from kvchat.engine.engine import Engine
from kvchat.engine.request import GenerationRequest
from kvchat.model.loader import load_model
from kvchat.model.transformer import _slots
from kvchat.native import build


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args()
    build.request(wait=True)
    model = load_model(None)
    places = {}
    for linear in model.transformer._linears():
        for name in _slots(type(linear)):
            t = getattr(linear, name, None)
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                places[(linear, name)] = {"huge": t, "plain": t.clone()}
    engine = Engine(model, EngineConfig(), start=False)
    prompt = tuple(range(1000, 1000 + args.context))
    engine.submit(GenerationRequest(prompt, max_tokens=1 << 30, ignore_eos=True), lambda e: None)
    for _ in range(5):
        engine.step()
    times: dict[str, list[float]] = {"huge": [], "plain": []}
    for r in range(args.rounds):
        for side in ("huge", "plain") if r % 2 == 0 else ("plain", "huge"):
            for (obj, name), copies in places.items():
                setattr(obj, name, copies[side])
            engine.step()
            for _ in range(args.steps):
                start = time.perf_counter()
                engine.step()
                times[side].append(time.perf_counter() - start)
    huge, plain = (statistics.median(times[s]) * 1e3 for s in ("huge", "plain"))
    rollup = Path("/proc/self/smaps_rollup")
    granted = next(
        (line.split(":")[1].strip() for line in rollup.read_text().splitlines()
         if line.startswith("AnonHugePages")), "unknown",
    ) if rollup.exists() else "unknown"  # fmt: skip
    print(
        f"decode step at ~{args.context} tokens: weights in huge pages {huge:.2f} ms, "
        f"in 4 KiB pages {plain:.2f} ms ({plain / huge:.2f}x); AnonHugePages {granted}"
    )
    engine.close()


if __name__ == "__main__":
    main()
