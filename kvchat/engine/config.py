"""The engine's knobs, with defaults chosen by measurement on a 2-core CPU (see README).

Sizes of the two cache tiers default to a share of the memory that is free at start,
so a user can read them (`kvchat` prints them) and override them with
`--device-cache` / `--host-cache`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvchat.errors import KvchatError

DEFAULT_PAGE_SIZE = 256


@dataclass(frozen=True)
class EngineConfig:
    page_size: int = DEFAULT_PAGE_SIZE
    device_cache_bytes: int | None = None  # None: derived from free memory
    host_cache_bytes: int | None = None  # None: derived from free memory; 0 disables the tier
    max_batch: int = 16  # sequences in one step
    # Tokens per step: decodes first, prefill chunks fill the rest. Large, because oneDNN's
    # bf16 matmuls are ~1.7x cheaper a row at 2,048 rows than at 512 on the 2-core target
    # (all linears of the default model: 118-129 vs 194-214 us a row), and because a
    # prompt taken in one chunk is attended by one causal call instead of chunk by chunk
    # over a prefix. Medians of 6 interleaved (`benchmarks/prefill_paths_ab.py`): a
    # 3,049-token prompt alone 1.35 s in one chunk of 3,072, 1.45 s in chunks of 2,048,
    # 1.63 s of 1,024; in another run with 4,096 too, a 6,144-token prompt took 3.76 /
    # 3.94 / 3.79 s in chunks of 3,072 / 2,048 / 4,096. Streams are protected by the
    # caps below, not by this; a prompt that arrives during another's long prefill, with
    # nothing streaming, waits for one step of up to ~1.3 s (3,072 tokens on this CPU).
    step_token_budget: int = 3072
    # While other requests are decoding, prefill chunks are capped at this many tokens a step,
    # so a long prompt slows their streams by a bounded factor (W3): measured on the 2-core
    # target (W3: a 4k-token ingest beside 3 streams), the streams' p99 inter-token latency
    # was 160 ms with 96-token chunks (ingest 4.8 s), 112 ms with 48 (6.7 s), 95 ms with 24
    # (12.7 s); 48 balances the streams against the ingesting session's wait.
    prefill_tokens_while_decoding: int = 48
    # ... and further capped at this many (new token x context token) pairs, since a
    # chunk's attention grows with the context it follows (see Scheduler._chunk_cap).
    prefill_work_while_decoding: int = 48 * 1024
    # The smallest chunk the pacer may shrink to. 5 tokens x 3 query heads a kv head are 15
    # query rows: one 16-row block of the attention kernel, and with three decodes still
    # under the 10 rows from which the linears switch to dense bf16 weights. At 8 tokens
    # both thresholds are crossed at once: a mixed step at ~3k tokens of context took 3.6x
    # a decode-only step (51.8 vs 14.2 ms), at 5 tokens 3.3x (39.3 vs 12.0 ms), and the
    # ingest moved as fast (`python benchmarks/w3_pacer.py`, AMD EPYC, ninth session).
    min_prefill_chunk: int = 5
    # Both caps above are then scaled, step by step, so that a step carrying a prefill chunk
    # beside streams takes about this many times a decode-only step (engine/step_pacer.py).
    # Measured on the 2-core target, AMD EPYC, with chunks through the attention kernel
    # (`kvchat bench --workloads W3`, runs one by one; streams' p99 inter-token latency
    # during the ingest over alone, ingest time): 4.0 with chunks of 8 at least: 3.02x,
    # 13.1 s (4.19x, 9.0 s in another); 3.0: 3.06/2.75/2.98x, 18-20 s; 2.5: 2.89/2.97/3.69x,
    # 18-21 s (the chunk sat at its floor: no faster streams, no slower ingest); 3.0 with
    # the floor at 5 tokens: 1.95/2.30/2.86x, 18-22 s.
    mixed_step_slowdown: float = 3.0
    max_skips: int = 8  # how often a waiting request may be overtaken by later ones
    max_rq_tokens: int = 2048  # a long generation requeues itself after this many tokens
    kv_format: str = "native"  # part of the page-hash salt
    # CPU attention through kvchat's compiled kernel (kvchat/native/) once it
    # has been built; False keeps torch's SDPA.
    native_attention: bool = True

    def __post_init__(self) -> None:
        ps = self.page_size
        if ps < 16 or ps & (ps - 1):
            raise KvchatError(f"--page-size must be a power of two from 16 up, got {ps}.")
        if self.kv_format not in ("native", "int8"):
            raise KvchatError(f"--kv must be native or int8, got {self.kv_format!r}.")
        if self.step_token_budget < self.max_batch:
            raise KvchatError("The step token budget must be at least the batch size.")


def available_memory(device: torch.device) -> int:
    """Bytes free now on the device (CUDA) or in RAM (CPU)."""
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def default_cache_bytes(device: torch.device) -> tuple[int, int]:
    """(device tier, host tier) sizes from the memory free at start.

    On CPU both tiers live in RAM: a tenth of it each, at most 1 GiB on the device tier
    (46k tokens of the default model in bf16) and 2 GiB on the host tier, so kvchat
    stays a good neighbour; `--device-cache`/`--host-cache` raise them.
    """
    if device.type == "cuda":
        device_bytes = int(available_memory(device) * 0.6)
        host_bytes = min(int(available_memory(torch.device("cpu")) * 0.25), 16 << 30)
        return device_bytes, host_bytes
    free = available_memory(device)
    return min(free // 10, 1 << 30), min(free // 10, 2 << 30)
