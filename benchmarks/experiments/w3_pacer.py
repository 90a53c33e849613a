"""W3 under several step-pacer settings, in one process, and what a mixed step costs.

    python benchmarks/experiments/w3_pacer.py [--slowdowns 4,3,2.5]

First, the cost floor the pacer works against: a step of three short streams, alone and
beside a prompt that is prefilled at the smallest chunk (`min_prefill_chunk` tokens a
step) and has reached 3,000 tokens (about 40 s: the prompt gets there 8 tokens a step).
Then W3 (three streams while a 4,049-token document is ingested) with
`mixed_step_slowdown` at each setting, run back to back on the same engine build.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time

from kvchat.bench import documents as docs
from kvchat.bench.peers.kvchat import KvchatPeer
from kvchat.engine.config import EngineConfig
from kvchat.engine.engine import Engine
from kvchat.engine.request import GenerationRequest
from kvchat.model.loader import load_model


def median_step_ms(engine: Engine, steps: int = 20) -> float:
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1e3


def ignore(_event) -> None:
    pass


def mixed_step_floor(model) -> None:
    chunk = EngineConfig().min_prefill_chunk
    config = EngineConfig(
        prefill_tokens_while_decoding=chunk,
        min_prefill_chunk=chunk,
        prefill_work_while_decoding=0,
        mixed_step_slowdown=1e9,  # the pacer never grows the chunk
    )
    with Engine(model, config, start=False) as engine:
        for i in range(3):
            prompt = tuple(range(3000 + 50 * i, 3040 + 50 * i))
            engine.submit(GenerationRequest(prompt, max_tokens=3000, ignore_eos=True), ignore)
        for _ in range(10):
            engine.step()
        decode = median_step_ms(engine)
        ingest = GenerationRequest(tuple(range(10000, 14000)), max_tokens=2, ignore_eos=True)
        engine.submit(ingest, ignore)
        engine.step()
        while max(s.num_computed for s in engine.scheduler.running) < 3000:
            engine.step()
        mixed = median_step_ms(engine)
    print(
        f"3 short streams: decode-only step {decode:.1f} ms; with a {chunk}-token prefill "
        f"chunk at ~3k tokens of context {mixed:.1f} ms ({mixed / decode:.1f}x)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slowdowns", default="4,3,2.5")
    args = parser.parse_args()
    model = load_model(None)
    mixed_step_floor(model)
    streams = [docs.user_prompt_ids(model, q) for q in docs.W3_QUESTIONS]
    code = docs.first_tokens(docs.stdlib_text(docs.W3_INGEST_FILE), model.tokenizer, 4000)
    ingest = docs.user_prompt_ids(model, docs.fenced(code, docs.SUMMARY_QUESTION))
    base_config = KvchatPeer.config
    for slowdown in (float(x) for x in args.slowdowns.split(",")):

        def config(self, *a, _slowdown=slowdown, **k):
            return dataclasses.replace(base_config(self, *a, **k), mixed_step_slowdown=_slowdown)

        KvchatPeer.config = config
        r = KvchatPeer(model, page_size=256).interference(streams, ingest, 64)
        alone, during = r["itl_p99_alone_s"], r["itl_p99_ingest_s"]
        print(
            f"pacer {slowdown}x: p50/p99 alone {r['itl_p50_alone_s'] * 1e3:.1f}/"
            f"{alone * 1e3:.1f} ms, during the ingest {r['itl_p50_ingest_s'] * 1e3:.1f}/"
            f"{during * 1e3:.1f} ms; p99 ratio {during / alone:.2f}; ingest {r['ingest_s']:.1f} s"
        )
    KvchatPeer.config = base_config


if __name__ == "__main__":
    main()
