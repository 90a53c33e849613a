"""What a start on CUDA does differently, checked on the CPU where it can be: the weights
note, the cache sizes from free GPU memory, the host-tier copies' side stream, and that
nothing CPU-only (huge pages, oneDNN packing, the native kernel) is reached."""

from __future__ import annotations

import torch

from kvchat.engine import config as engine_config
from kvchat.engine.attention.attention_choice import resolve_attention
from kvchat.engine.tiers.copy_stream import CopyStream
from kvchat.model.linear import pack_weight
from kvchat.model.loader import dense_weights_note

CUDA = torch.device("cuda")


def test_a_gguf_start_on_cuda_says_its_4bit_weights_are_dequantized() -> None:
    assert "4-bit weights dequantized on CUDA" in dense_weights_note(CUDA, True, "native", None)
    assert "--quantize int4 is not applied on CUDA" in dense_weights_note(
        CUDA, False, "native", "int4"
    )
    assert dense_weights_note(CUDA, True, "bf16", None) is None  # asked for dense: no note
    assert dense_weights_note(torch.device("cpu"), True, "native", None) is None


def test_cuda_cache_sizes_follow_free_gpu_memory(monkeypatch) -> None:
    free = {"gpu": 40 << 30}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free["gpu"], 80 << 30))
    device_bytes, _host = engine_config.default_cache_bytes(CUDA)
    free["gpu"] = 10 << 30
    smaller, _host = engine_config.default_cache_bytes(CUDA)
    assert 0 < smaller < device_bytes < 40 << 30
    assert smaller == device_bytes // 4


class FakeCuda:
    """Records what `CopyStream` asks of torch.cuda, in order."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        fake = self

        class Stream:
            def __init__(self, device) -> None:
                self.name = "side"

            def wait_stream(self, other) -> None:
                fake.calls.append(f"side waits for {other.name}")

            def record_event(self):
                fake.calls.append("side records")
                return "event"

            def wait_event(self, event) -> None:
                fake.calls.append(f"{self.name} waits for {event}")

        self.Stream = Stream
        self.compute = Stream(None)
        self.compute.name = "compute"

    def current_stream(self, device):
        return self.compute

    def stream(self, s):
        calls = self.calls

        class Context:
            def __enter__(self):
                calls.append(f"on {s.name}")

            def __exit__(self, *exc):
                calls.append(f"off {s.name}")

        return Context()


def test_host_tier_copies_run_on_a_side_stream_the_compute_waits_for_once() -> None:
    cuda = FakeCuda()
    side = CopyStream(CUDA, cuda)
    side.wait()
    assert cuda.calls == []  # nothing issued: the compute does not wait
    with side.copies():
        cuda.calls.append("copy")
    assert side.pending
    side.wait()
    side.wait()
    assert cuda.calls == [
        "side waits for compute",  # a page is saved after its last write
        "on side",
        "copy",
        "off side",
        "side records",
        "compute waits for event",  # once, before the next forward
    ]
    assert not side.pending


def test_nothing_cpu_only_is_reached_off_the_cpu(monkeypatch) -> None:
    """A store and a weight on another device ("meta" stands in for CUDA): no huge pages,
    no oneDNN packing, no CPU kernel."""
    from kvchat.engine.tiers.kv_store import DeviceKVStore
    from kvchat.model import huge_pages

    def refuse(*args, **kwargs):
        raise AssertionError("huge pages requested off the CPU")

    monkeypatch.setattr(huge_pages, "empty", refuse)
    store = DeviceKVStore(2, 4, 16, 2, 16, torch.bfloat16, "meta")
    assert store.device.type == "meta"
    weight = torch.randn(8, 8).to(torch.bfloat16)
    assert pack_weight(weight.to("meta")) is None  # oneDNN packing is for CPU tensors only
    assert resolve_attention(None, CUDA) == "flex"  # not the CPU kernel
