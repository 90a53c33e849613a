"""The engine's knobs, with defaults chosen by measurement on a 2-core CPU (docs/scheduler.md).

Sizes of the two cache tiers default to a share of the memory that is free at start,
so a user can read them (`kvchat` prints them) and override them with
`--device-cache` / `--host-cache`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from kvchat.errors import KvchatError

DEFAULT_PAGE_SIZE = 256


@dataclass(frozen=True)
class EngineConfig:
    page_size: int = DEFAULT_PAGE_SIZE
    device_cache_bytes: int | None = None  # None: derived from free memory
    host_cache_bytes: int | None = None  # None: derived from free memory; 0 disables the tier
    # 0 (off) for an engine made in code; the CLI sizes it (`default_disk_cache_bytes`).
    disk_cache_bytes: int = 0
    disk_cache_dir: Path | None = None  # None: the user cache folder's `kv` (kvchat paths)
    max_batch: int = 16  # sequences in one step
    # Tokens per step: decodes first, prefill chunks fill the rest. Large, because bf16
    # matmuls cost less a row in big chunks and a prompt in one chunk is attended by one
    # causal call; streams are protected by the caps below (measured: docs/scheduler.md).
    step_token_budget: int = 3072
    # While other requests are decoding, prefill chunks are capped at this many tokens a step,
    # so a long prompt slows their streams by a bounded factor (W3; docs/scheduler.md).
    prefill_tokens_while_decoding: int = 48
    # ... and further capped at this many (new token x context token) pairs, since a
    # chunk's attention grows with the context it follows (see Scheduler._chunk_cap).
    prefill_work_while_decoding: int = 48 * 1024
    # The smallest chunk the pacer may shrink to: 5 tokens x 3 query heads a kv head are 15
    # query rows, one 16-row block of the attention kernel, and with three decodes still
    # under the 10 rows from which the linears switch to dense bf16 (docs/scheduler.md).
    min_prefill_chunk: int = 5
    # Both caps above are then scaled, step by step, so that a step carrying a prefill chunk
    # beside streams takes about this many times a decode-only step (engine/step_pacer.py;
    # the W3 runs behind the value: docs/scheduler.md).
    mixed_step_slowdown: float = 3.0
    # A step with no stream in it (a prompt or a type-ahead prefilling alone) is sized to take
    # about this long, from the measured prefill rate: a prompt that arrives from another
    # session waits for the step under way, and the token budget alone took 2-3 s a step on
    # a float32 CPU (docs/scheduler.md). 0: the token budget only.
    prefill_step_s: float = 1.0
    max_skips: int = 8  # how often a waiting request may be overtaken by later ones
    max_rq_tokens: int = 2048  # a long generation requeues itself after this many tokens
    kv_format: str = "native"  # part of the page-hash salt
    # the most tokens a sequence may hold (prompt and reply): the model's context, or
    # fewer (--context-size), which bounds a conversation's KV cache and its prompt
    context_tokens: int | None = None
    # Which attention reads the cache (engine/attention/attention_choice.py): "native" (kvchat's CPU
    # kernel once built), "flex" (torch's FlexAttention, compiled) or "sdpa"; None: the
    # device's default (flex on CUDA, native elsewhere).
    attention: str | None = None
    # A model with windowed layers (Gemma 3, gpt-oss) keeps their K/V in slots of their own,
    # for the pages within a window of a live sequence and the idle parts a slot can spare
    # (engine/cache/window_slots.py); None: sized from the device cache (kv_cache.py).
    window_slots: int | None = None

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
