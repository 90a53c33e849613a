"""Prefill paths side by side in one process: the step token budget, and how a chunk
reads a cached prefix.

    python benchmarks/experiments/prefill_paths_ab.py [--prompt 3049] [--history 6152] [--rounds 6]

Two comparisons on the default model, each variant's runs interleaved with the others'
(the order reversed every round) so the machine's drift hits all alike; medians printed:

1. budget: one prompt of `--prompt` tokens alone, prefilled in chunks of 1,024, 2,048
   and 3,072 tokens (`EngineConfig.step_token_budget`; one engine per budget).
2. prefix: two conversations of `--history` tokens, A then B, then 20 new tokens on A,
   stepped back to back as the bench does (no idle step, so nothing is defragmented and
   A's new page lies after B's): the follow-up's step with the prefix read run by run
   (`MAX_PREFIX_RUNS` 8) against one gathered copy under a mask (0).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable, Sequence

from kvchat.engine.attention import paged_attention
from kvchat.engine.config import EngineConfig
from kvchat.engine.engine import Engine
from kvchat.engine.events import RequestFinished
from kvchat.engine.request import GenerationRequest
from kvchat.model.loader import load_model
from kvchat.native import build

CACHE = dict(device_cache_bytes=600 << 20, host_cache_bytes=0)


class _Tokens:
    """Fresh random token ids for every run (a cache hit would time nothing; sequential
    ids wrapped around the vocabulary after a few long prompts and repeated them)."""

    def __init__(self, vocab: int, seed: int = 0) -> None:
        self.vocab = vocab
        self.rng = random.Random(seed)

    def take(self, n: int) -> tuple[int, ...]:
        return tuple(self.rng.randrange(100, self.vocab) for _ in range(n))


def prefill(engine: Engine, prompt: Sequence[int]) -> float:
    """Seconds until the prompt's first token: steps back to back, idle work after."""
    done: list = []
    engine.submit(GenerationRequest(tuple(prompt), max_tokens=1, ignore_eos=True), done.append)
    start = time.perf_counter()
    while not done or not isinstance(done[-1], RequestFinished):
        engine.step()
    elapsed = time.perf_counter() - start
    if done[-1].error:
        raise SystemExit(done[-1].error)
    return elapsed


def interleave(runs: dict[str, Callable[[], float]], rounds: int) -> dict[str, list[float]]:
    names = list(runs)
    out: dict[str, list[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            out[name].append(runs[name]())
    return out


def report(title: str, results: dict[str, list[float]], unit: float, suffix: str) -> None:
    print(title)
    for name, xs in results.items():
        runs = " ".join(f"{x * unit:.2f}" for x in xs)
        print(f"  {name:>24}: median {statistics.median(xs) * unit:.3f} {suffix}  ({runs})")


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--prompt", type=int, default=3049)
    parser.add_argument("--history", type=int, default=6152)
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    build.request(wait=True)
    model = load_model(None)
    tokens = _Tokens(model.config.vocab_size)

    budgets = {b: Engine(model, EngineConfig(step_token_budget=b, **CACHE), start=False)
               for b in (1024, 2048, 3072)}  # fmt: skip

    def budget_run(b: int) -> Callable[[], float]:
        def run() -> float:
            elapsed = prefill(budgets[b], tokens.take(args.prompt))
            budgets[b].run_until_idle()
            return elapsed

        return run

    results = interleave({f"chunks of {b}": budget_run(b) for b in budgets}, args.rounds)
    report(f"1. a {args.prompt}-token prompt alone, by step token budget", results, 1, "s")
    for engine in budgets.values():
        engine.close()

    engine = Engine(model, EngineConfig(**CACHE), start=False)
    history = tokens.take(args.history)
    prefill(engine, history)
    prefill(engine, tokens.take(args.history))  # B: A's next page now lies after B's

    def prefix_run(max_runs: int) -> Callable[[], float]:
        def run() -> float:
            paged_attention.MAX_PREFIX_RUNS = max_runs
            return prefill(engine, history + tokens.take(20))

        return run

    default_runs = paged_attention.MAX_PREFIX_RUNS
    results = interleave(
        {"prefix run by run": prefix_run(default_runs), "gathered, masked": prefix_run(0)},
        args.rounds,
    )
    paged_attention.MAX_PREFIX_RUNS = default_runs
    report(f"2. 20 new tokens after {args.history} scattered tokens", results, 1e3, "ms")

    engine.close()


if __name__ == "__main__":
    main()
