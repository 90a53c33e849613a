"""A 4-bit decode step with the layers' small ops fused (kvchat's kernels) against the
same ops in torch, interleaved in one process so the machine's drift hits both alike.

    python benchmarks/experiments/decoder_ops_ab.py [--context 512] [--rounds 6] [--steps 40]

One request decodes on an engine stepped by hand; each round runs `--steps` steps with
the fused ops, then as many with torch's, alternating which goes first. Prints each
side's median step and the ratio.
"""

from __future__ import annotations

from interleaved import ab_arguments, decoding_engine, interleaved_medians

from kvchat.model import decoder_ops
from kvchat.native import build


def main() -> None:
    args = ab_arguments(__doc__, rounds=6, steps=40)
    model, engine = decoding_engine(args.context)
    native = decoder_ops._native

    def switch(side: str) -> None:
        decoder_ops._native = native if side == "fused" else (lambda x: False)

    medians = interleaved_medians(
        engine, ("fused", "torch"), switch, rounds=args.rounds, steps=args.steps
    )
    decoder_ops._native = native
    fused, plain = medians["fused"], medians["torch"]
    print(f"attention: {build.summary(model.transformer.device)}")
    print(
        f"decode step at ~{args.context} tokens: fused small ops {fused:.2f} ms, "
        f"torch's {plain:.2f} ms ({plain / fused:.2f}x)"
    )
    engine.close()


if __name__ == "__main__":
    main()
