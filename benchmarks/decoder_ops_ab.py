"""A 4-bit decode step with the layers' small ops fused (kvchat's kernels) against the
same ops in torch, interleaved in one process so the machine's drift hits both alike.

    python benchmarks/decoder_ops_ab.py [--context 512] [--rounds 6] [--steps 40]

One request decodes on an engine stepped by hand; each round runs `--steps` steps with
the fused ops, then as many with torch's, alternating which goes first. Prints each
side's median step and the ratio.
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvchat.engine.config import EngineConfig
from kvchat.engine.engine import Engine
from kvchat.engine.request import GenerationRequest
from kvchat.model import decoder_ops
from kvchat.model.loader import load_model
from kvchat.native import build


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    build.request(wait=True)
    native = decoder_ops._native
    model = load_model(None)
    engine = Engine(model, EngineConfig(), start=False)
    prompt = tuple(range(1000, 1000 + args.context))
    engine.submit(GenerationRequest(prompt, max_tokens=1 << 30, ignore_eos=True), lambda e: None)
    for _ in range(5):
        engine.step()
    times: dict[str, list[float]] = {"fused": [], "torch": []}
    for r in range(args.rounds):
        for side in ("fused", "torch") if r % 2 == 0 else ("torch", "fused"):
            decoder_ops._native = native if side == "fused" else (lambda x: False)
            engine.step()  # one step to settle after the switch
            for _ in range(args.steps):
                start = time.perf_counter()
                engine.step()
                times[side].append(time.perf_counter() - start)
    decoder_ops._native = native
    fused, plain = (statistics.median(times[s]) * 1e3 for s in ("fused", "torch"))
    print(f"attention: {build.summary(model.transformer.device)}")
    print(
        f"decode step at ~{args.context} tokens: fused small ops {fused:.2f} ms, "
        f"torch's {plain:.2f} ms ({plain / fused:.2f}x)"
    )
    engine.close()


if __name__ == "__main__":
    main()
