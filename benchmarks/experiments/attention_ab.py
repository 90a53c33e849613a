"""Decode speed with kvchat's attention kernel against torch's SDPA, interleaved in one process.

    python benchmarks/experiments/attention_ab.py [--contexts 512,3072,6144] [--repeats 3] \
        [--kv int8]

For each context length: a session reads a document of that many tokens and answers
with 64 tokens; the decode rate is taken after the first token. The two attentions
alternate run by run in one process, so the machine's drift (its L3 is shared with
other tenants) hits both alike. Prints the median ms per token of each.
"""

from __future__ import annotations

import argparse
import statistics
import time

from kvchat.bench import documents as docs
from kvchat.bench.peers.kvchat import KvchatPeer
from kvchat.model.loader import load_model
from kvchat.native import build as native_build

ANSWER_TOKENS = 64
SETUPS = {"kvchat's kernel": True, "torch SDPA": False}  # name: attention kernel on


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", default="512,3072,6144")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--model", default=None, help="default: SmolLM2-135M-Instruct")
    parser.add_argument("--kv", default="native", choices=("native", "int8"), help="KV format")
    args = parser.parse_args()
    model = load_model(args.model)
    peer = KvchatPeer(model, page_size=256, kv_format=args.kv)  # waits for the kernel's build
    print(f"kernels: {native_build.status().detail}")
    results: dict[tuple[int, str], list[float]] = {}
    for context in (int(c) for c in args.contexts.split(",")):
        history = docs.history_of(model, docs.SWEEP_FILES[0], context)
        for _ in range(args.repeats):
            for name, attention in SETUPS.items():
                chat = peer.chat(2 * (context + 4 * ANSWER_TOKENS + 128))
                chat.engine.attention.native_enabled = attention
                session = chat.new_session()
                start = time.perf_counter()
                turn = chat.turn(session, history, ANSWER_TOKENS)
                elapsed = time.perf_counter() - start
                per_token = (elapsed - turn.ttft_s) / (ANSWER_TOKENS - 1)
                results.setdefault((context, name), []).append(per_token * 1e3)
                chat.close()
        base = statistics.median(results[(context, "torch SDPA")])
        for name in SETUPS:
            ms = statistics.median(results[(context, name)])
            print(
                f"context {context:>5}, {name:<15}: {ms:5.1f} ms/token "
                f"({1e3 / ms:5.1f} tok/s, {base / ms:.2f}x SDPA's)"
            )


if __name__ == "__main__":
    main()
