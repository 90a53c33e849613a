"""Whether the KV cache sizes asked for fit in this machine's memory, checked before allocating.

Why refuse rather than try: an allocation larger than the machine fails with the
allocator's raw error, or, on a CPU, succeeds lazily (the pages are committed as they
are first written) and the idle engine then faults them in until the machine swaps or
the kernel kills a process. On a CPU the device cache, the host cache and the
weights share the same RAM, so all three must fit in what was available before the
model loaded; on a GPU the device cache must fit in the GPU's free memory and the host
cache in the RAM. `HEADROOM` leaves room for activations, the tokenizer and Python.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from kvchat.errors import UsageError
from kvchat.units import format_size

HEADROOM = 0.9  # the share of the available memory kvchat plans to use


@dataclass(frozen=True)
class CacheRequest:
    """The two tiers' sizes in bytes and where each came from ("--device-cache", a
    settings line, or None for kvchat's default)."""

    device_bytes: int
    host_bytes: int
    device_source: str | None = None
    host_source: str | None = None

    @classmethod
    def of(cls, device_bytes: int, host_bytes: int, sources: Mapping[str, str]) -> CacheRequest:
        return cls(device_bytes, host_bytes, sources.get("device_cache"), sources.get("host_cache"))


def _described(what: str, size: int, source: str | None) -> str:
    return f"{what} {format_size(size)} (from {source or 'the default'})"


def _advice(request: CacheRequest, room: int, names: tuple[str, ...]) -> str:
    """Which size to lower and to what, naming the flag or the settings line it came from."""
    set_by_user = [
        (name, source)
        for name, source in zip(
            ("device", "host"), (request.device_source, request.host_source), strict=True
        )
        if name in names and source is not None
    ]
    if not set_by_user:
        return "lower --device-cache or --host-cache"
    name, source = set_by_user[0]
    flag = f"--{name}-cache"
    return f"give {flag} a smaller size (set by {source}), at most {format_size(max(room, 0))}"


def check_cpu_budget(request: CacheRequest, weight_bytes: int, available_ram: int) -> None:
    """UsageError unless device cache + host cache + weights fit in the available RAM."""
    budget = int(available_ram * HEADROOM)
    need = request.device_bytes + request.host_bytes + weight_bytes
    if need <= budget:
        return
    device_room = budget - weight_bytes - request.host_bytes
    host_room = budget - weight_bytes - request.device_bytes
    room = device_room if request.device_source is not None else host_room
    raise UsageError(
        f"the KV cache does not fit in this machine's memory: "
        f"{_described('device cache', request.device_bytes, request.device_source)} + "
        f"{_described('host cache', request.host_bytes, request.host_source)} + the model's "
        f"weights {format_size(weight_bytes)} = {format_size(need)}, but "
        f"{format_size(available_ram)} is available (kvchat uses at most "
        f"{HEADROOM:.0%}); {_advice(request, room, ('device', 'host'))}."
    )


def check_gpu_budget(request: CacheRequest, available_gpu: int, available_ram: int) -> None:
    """UsageError unless the device cache fits in the GPU's free memory and the host cache
    in the available RAM."""
    if request.device_bytes > available_gpu * HEADROOM:
        raise UsageError(
            f"the device cache does not fit on the GPU: "
            f"{_described('device cache', request.device_bytes, request.device_source)}, but "
            f"{format_size(available_gpu)} of GPU memory is free after the weights loaded; "
            f"{_advice(request, int(available_gpu * HEADROOM), ('device',))}."
        )
    if request.host_bytes > available_ram * HEADROOM:
        raise UsageError(
            f"the host cache does not fit in this machine's memory: "
            f"{_described('host cache', request.host_bytes, request.host_source)}, but "
            f"{format_size(available_ram)} is available; "
            f"{_advice(request, int(available_ram * HEADROOM), ('host',))}."
        )
