"""A 4-bit decode step with the weights in 2 MiB pages (as kvchat places them) against
the same weights in ordinary 4 KiB pages, interleaved in one process.

    python benchmarks/experiments/huge_pages_ab.py [--context 512] [--rounds 8] [--steps 30]

One request decodes on an engine stepped by hand; each round runs `--steps` steps on
each placement, alternating which goes first, by swapping every linear layer's tensors
between the huge-page arena the model built and plain copies of them. Prints each side's
median step and the process's AnonHugePages (0 kB means the OS granted no huge pages:
THP off, and the A/B compares like with like).
"""

from __future__ import annotations

from pathlib import Path

import torch
from interleaved import ab_arguments, decoding_engine, interleaved_medians

from kvchat.model.transformer import _slots


def main() -> None:
    args = ab_arguments(__doc__, rounds=8, steps=30)
    model, engine = decoding_engine(args.context)
    places = {}
    for linear in model.transformer._linears():
        for name in _slots(type(linear)):
            t = getattr(linear, name, None)
            if isinstance(t, torch.Tensor) and t.layout == torch.strided:
                places[(linear, name)] = {"huge": t, "plain": t.clone()}

    def switch(side: str) -> None:
        for (obj, name), copies in places.items():
            setattr(obj, name, copies[side])

    medians = interleaved_medians(
        engine, ("huge", "plain"), switch, rounds=args.rounds, steps=args.steps
    )
    huge, plain = medians["huge"], medians["plain"]
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
