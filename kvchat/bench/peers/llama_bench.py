"""llama-bench as llama.cpp's speed peer: its own figures, on the file kvchat loads.

llama.cpp's speed is what its users quote from llama-bench, so the speed workload runs
llama-bench itself rather than timing llama.cpp through a binding: on the same GGUF
file kvchat loads, with kvchat's thread count, the plan's prefill lengths (`-p`, its pp
tests: the prompt in one batch) and the plan's decode token count (`-n`, its tg tests),
both at a depth of the plan's decode prompt (`-d`: the decode after a long prompt) and
from an empty context (the decode from a short prompt, where kvchat starts after 16
tokens). Each bench repeat runs llama-bench once with one repetition (`-r 1`, after
its own warm-up): the bench interleaves the repeats of every engine, so a noisy
stretch of the machine falls on all of them alike, where llama-bench's own five
repetitions would fall on it alone. Its JSON output (`-o json`) gives one row per test;
its peak memory is the largest of its runs' (`peak_memory.run_measured`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from kvchat.bench.llama_cpp_tools import build_simd
from kvchat.bench.peak_memory import PeakRss, run_measured
from kvchat.bench.peers.base import BatchResult, NotApplicable, PeerUnavailable, SpeedResult
from kvchat.errors import KvchatError

RUN_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class LlamaBenchRow:
    """One test of llama-bench's JSON output: a pp test (n_prompt tokens in one batch),
    or a tg test (n_gen tokens one at a time), after n_depth tokens already in context."""

    n_prompt: int
    n_gen: int
    n_depth: int
    avg_ts: float  # tokens per second, the mean over its repetitions
    stddev_ts: float


def parse_rows(text: str) -> list[LlamaBenchRow]:
    """llama-bench's `-o json` output as rows; an error naming what is wrong otherwise."""
    try:
        tests = json.loads(text)
        return [
            LlamaBenchRow(
                int(t["n_prompt"]),
                int(t["n_gen"]),
                int(t.get("n_depth", 0)),
                float(t["avg_ts"]),
                float(t.get("stddev_ts", 0.0)),
            )
            for t in tests
        ]
    except (ValueError, TypeError, KeyError) as exc:
        raise KvchatError(
            f"llama-bench's JSON output could not be read ({exc}): {text[:300]}"
        ) from exc


def speed_of(
    rows: Sequence[LlamaBenchRow],
    prefill_lengths: Sequence[int],
    decode_prompt: int,
    decode_tokens: int,
) -> SpeedResult:
    """The speed workload's figures from llama-bench's rows: pp at each prefill length
    from an empty context, tg of `decode_tokens` at a depth of `decode_prompt` and at 0."""

    def rate(n_prompt: int, n_gen: int, depth: int) -> float:
        for row in rows:
            if (row.n_prompt, row.n_gen, row.n_depth) == (n_prompt, n_gen, depth):
                return row.avg_ts
        raise KvchatError(
            f"llama-bench gave no test of {n_prompt} prompt and {n_gen} generated tokens "
            f"at a depth of {depth}"
        )

    return SpeedResult(
        {n: rate(n, 0, 0) for n in prefill_lengths},
        rate(0, decode_tokens, decode_prompt),
        rate(0, decode_tokens, 0),
    )


class LlamaBenchPeer:
    """llama-bench of one llama.cpp build on one GGUF file (speed only)."""

    name = "llama-bench"

    def __init__(self, binary: Path, gguf: Path, threads: int) -> None:
        if gguf.suffix.lower() != ".gguf" or not gguf.is_file():
            raise PeerUnavailable(
                f"llama-bench measures GGUF files; the model is not one ({gguf.name})"
            )
        self.binary, self.gguf, self.threads = binary, gguf, threads
        self.peak_bytes = 0  # the largest peak resident memory of its runs so far
        simd = build_simd(binary) or ""
        isa = "AVX-512" if "-DGGML_AVX512=ON" in simd else "AVX2" if "AVX2=ON" in simd else "its"
        self.description = (
            f"llama-bench ({binary.parent.parent.name}, {isa} build), {gguf.name}, "
            f"{threads} threads, one repetition a run after its warm-up; decode: its tg "
            "tests at a depth of the long prompt and from an empty context"
        )

    def speed(
        self,
        prompt_ids: Sequence[int],
        prefill_lengths: Sequence[int],
        decode_prompt: int,
        decode_tokens: int,
    ) -> SpeedResult:
        """llama-bench's pp and tg tests at the plan's sizes (it makes its own tokens)."""
        prefill = self._run(["-p", ",".join(map(str, prefill_lengths)), "-n", "0"])
        decode = self._run(["-p", "0", "-n", str(decode_tokens), "-d", f"{decode_prompt},0"])
        return speed_of([*prefill, *decode], prefill_lengths, decode_prompt, decode_tokens)

    def _run(self, tests: list[str]) -> list[LlamaBenchRow]:
        argv = [str(self.binary), "-m", str(self.gguf), *tests]
        argv += ["-t", str(self.threads), "-r", "1", "-o", "json"]
        env = {**os.environ, "LD_LIBRARY_PATH": str(self.binary.parent)}
        done = run_measured(argv, env=env, timeout=RUN_TIMEOUT_S)
        self.peak_bytes = max(self.peak_bytes, done.peak_bytes)
        if done.returncode != 0:
            raise KvchatError(f"llama-bench failed ({done.returncode}): {done.stderr[-1000:]}")
        return parse_rows(done.stdout)

    def batch(self, prompts: Sequence[Sequence[int]], tokens_each: int) -> BatchResult:
        raise NotApplicable(
            "llama-bench measures one sequence; llama.cpp's batched figures are llama-server's"
        )

    def weight_bytes(self) -> int:
        return self.gguf.stat().st_size

    def peak_rss(self) -> PeakRss | None:
        """llama-bench's own peak over its runs (None before it ran)."""
        return PeakRss(self.peak_bytes, self.name, shared=False) if self.peak_bytes else None

    def close(self) -> None:
        pass
