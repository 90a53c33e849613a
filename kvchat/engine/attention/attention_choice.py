"""Which attention reads the paged KV cache: `--attention native|flex|sdpa`.

- native: kvchat's own CPU kernel (`native_attention`, torch's SDPA until it is built);
  the CPU's default. It has no CUDA build, so it is refused there.
- flex: torch's FlexAttention, compiled (`flex_attention`); CUDA's default, and it runs
  on a CPU too, which is how the tests check the code a GPU runs.
- sdpa: torch's `scaled_dot_product_attention` over each sequence's pages (`PagedAttention`
  without the kernel), on any device.
"""

from __future__ import annotations

import torch

from kvchat.errors import UsageError

ATTENTION_CHOICES = ("native", "flex", "sdpa")
NATIVE_ON_CUDA = (
    "--attention native is kvchat's CPU kernel and does not run on CUDA; "
    "use --attention flex (the default on CUDA) or --attention sdpa."
)


def default_attention(device: torch.device) -> str:
    """flex on CUDA, native elsewhere."""
    return "flex" if device.type == "cuda" else "native"


def resolve_attention(
    choice: str | None, device: torch.device, kv_format: str = "native", *, sinks: bool = False
) -> str:
    """The attention an engine on `device` runs for `choice` (None: the device's default);
    a `UsageError` saying what to use instead when the device, the KV format or the model
    (`sinks`: its softmax has attention sinks, which flex computes on CUDA only) cannot
    run it."""
    if choice is None:
        choice = default_attention(device)
    if choice not in ATTENTION_CHOICES:
        raise UsageError(
            f"--attention must be one of {', '.join(ATTENTION_CHOICES)}, not {choice!r}."
        )
    if choice == "native" and device.type != "cpu":
        raise UsageError(NATIVE_ON_CUDA)
    if choice == "flex":
        from kvchat.engine.attention.flex_attention import FLEX_SINKS_ON_CPU, check_kv_format

        check_kv_format(kv_format)
        if sinks and device.type == "cpu":
            raise UsageError(FLEX_SINKS_ON_CPU)
    return choice


def make_attention(
    store, choice: str, *, max_batch: int = 16, window_store=None, groups=None, unkept_slot=None
):
    """The `Attention` of a forward pass over a `DeviceKVStore`, for a resolved `choice`;
    with a `window_store` (the windowed layers', `groups` saying which), over both."""
    if window_store is not None:
        from kvchat.engine.attention.grouped_attention import GroupedAttention

        full = make_attention(store, choice, max_batch=max_batch)
        from kvchat.engine.cache.window_slots import UNKEPT

        windowed = make_attention(window_store, choice, max_batch=max_batch, unkept_slot=UNKEPT)
        return GroupedAttention(full, windowed, groups)
    if choice == "flex":
        from kvchat.engine.attention.flex_attention import FlexPagedAttention

        return FlexPagedAttention.for_store(store, max_batch=max_batch, unkept_slot=unkept_slot)
    from kvchat.engine.attention.paged_attention import PagedAttention

    attention = PagedAttention.for_store(store)
    attention.native_enabled = choice == "native"
    return attention


def describe_attention(choice: str, device: torch.device) -> str:
    """A few words for the start-up line: which attention serves the engine."""
    if choice == "flex":
        return (
            "torch FlexAttention, compiled (the first compile of each shape takes a while, "
            "tens of seconds; later starts reuse it from the cache folder)"
        )
    if choice == "sdpa":
        return "torch SDPA"
    from kvchat.native import build as native_build

    return native_build.summary(device)
