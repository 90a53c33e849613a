"""How long a short question waits behind another session's long prompt, by prefill bound.

    python benchmarks/experiments/cross_session_wait.py [--bounds 0,1.0,0.5] [--repeats 3]

A 2,242-token pasted document is submitted on an idle engine (its prefill steps carry
no stream, so only the step bound limits them); 0.3 s later a 16-token question from
another session arrives. The question's time to first token is its wait for the step
under way plus its own prefill; the document's time to first token is what the bound
costs it. Bound 0 is the token budget alone (3,072 tokens a step). Each bound runs on a
fresh engine over the same loaded model, interleaved across repeats, caches cleared.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import threading
import time

from kvchat.bench import documents as docs
from kvchat.bench.machine import machine_info, machine_line
from kvchat.bench.peers.kvchat import KvchatPeer
from kvchat.engine.engine import Engine
from kvchat.engine.events import RequestFinished, TokenGenerated
from kvchat.engine.request import GenerationRequest
from kvchat.model.loader import load_model

DOCUMENT_TOKENS = 2242
QUESTION_AFTER_S = 0.3


class FirstToken:
    def __init__(self) -> None:
        self.at: float | None = None
        self.done = threading.Event()

    def __call__(self, event) -> None:
        if isinstance(event, TokenGenerated) and self.at is None:
            self.at = time.monotonic()
        if isinstance(event, RequestFinished):
            self.done.set()


def one_run(model, config, document, question) -> tuple[float, float]:
    """(question's TTFT, document's TTFT) in seconds."""
    with Engine(model, config) as engine:
        engine.submit(GenerationRequest((1, 2, 3), max_tokens=1), FirstToken())  # warm
        time.sleep(1.0)
        doc, ask = FirstToken(), FirstToken()
        start = time.monotonic()
        engine.submit(GenerationRequest(document, max_tokens=1), doc)
        time.sleep(QUESTION_AFTER_S)
        asked = time.monotonic()
        engine.submit(GenerationRequest(question, max_tokens=1), ask)
        assert doc.done.wait(120) and ask.done.wait(120)
        return ask.at - asked, doc.at - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bounds", default="0,1.0,0.5")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model = load_model(None)
    text = docs.first_tokens(docs.stdlib_text(docs.W3_INGEST_FILE), model.tokenizer, 4000)
    document = tuple(docs.user_prompt_ids(model, docs.fenced(text, docs.SUMMARY_QUESTION)))
    document = document[-DOCUMENT_TOKENS:]
    question = tuple(docs.user_prompt_ids(model, "What is a page table?"))[:16]
    bounds = [float(b) for b in args.bounds.split(",")]
    results: dict[float, list[tuple[float, float]]] = {b: [] for b in bounds}
    peer = KvchatPeer(model, page_size=16)
    base = peer.config(8192)
    for _ in range(args.repeats):
        for bound in bounds:
            config = dataclasses.replace(base, prefill_step_s=bound)
            results[bound].append(one_run(model, config, document, question))
    transformer = model.transformer
    print(machine_line(machine_info(transformer.device, transformer.dtype)))
    print(
        f"{len(document)}-token document, {len(question)}-token question {QUESTION_AFTER_S} s later"
    )
    for bound, runs in results.items():
        wait = statistics.median(r[0] for r in runs)
        doc = statistics.median(r[1] for r in runs)
        label = f"{bound:.2f} s" if bound else "none"
        print(
            f"prefill step bound {label:>7}: question TTFT {wait:.2f} s, document TTFT {doc:.2f} s"
            f" (runs: {', '.join(f'{r[0]:.2f}/{r[1]:.2f}' for r in runs)})"
        )


if __name__ == "__main__":
    main()
