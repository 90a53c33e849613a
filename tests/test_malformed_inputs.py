"""Property tests: whatever a script line or a model file's header holds, kvchat ends in one
clear error (a `KvchatError`), never another exception, and never hangs.

The model files are a real tiny GGUF and a real safetensors file, then cut short, given
overflowing lengths and counts, wrong element types, or bytes overwritten at random in
their headers. Each example runs under an alarm, so a parser caught in a loop fails the
test instead of hanging it.
"""

from __future__ import annotations

import contextlib
import json
import signal
import struct
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import save_file

from kvchat.errors import KvchatError
from kvchat.model.gguf.convert import gguf_to_hf_config
from kvchat.model.gguf.file import GGUFFile
from kvchat.model.gguf.tokenizer import tokenizer_parts_from_gguf
from kvchat.model.safetensors_folder import read_tensors
from kvchat.script import parse_script
from tests.tiny_gguf import write_tiny_gguf

SECONDS_PER_EXAMPLE = 20  # generous: the machine is shared; a hang takes forever
FUZZ = settings(
    max_examples=120,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


@contextlib.contextmanager
def no_hang():
    def fire(_signum, _frame):
        raise AssertionError(f"no answer within {SECONDS_PER_EXAMPLE} s: a hang")

    previous = signal.signal(signal.SIGALRM, fire)
    signal.alarm(SECONDS_PER_EXAMPLE)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


# ------------------------------------------------------------------ script lines

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=12),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=6,
)
KEYS = ["op", "session", "text", "file", "system", "title", "max_tokens", "temperature",
        "top_p", "top_k", "min_p", "seed", "ignore_eos", "seconds"]  # fmt: skip
OPS = ["new", "say", "draft", "pause", "wait", "stop", "switch", "stats", "nope", ""]
script_objects = st.dictionaries(
    st.sampled_from(KEYS) | st.text(max_size=8),
    st.sampled_from(OPS) | st.sampled_from(["a", "b", "doc.txt", "/etc/hostname"]) | json_values,
    max_size=5,
)
script_lines = st.one_of(
    script_objects.map(json.dumps),
    st.text(max_size=40),  # not JSON at all
    json_values.map(json.dumps),  # JSON, but not an object
)


@FUZZ
@given(lines=st.lists(script_lines, max_size=8))
def test_any_script_is_parsed_or_refused_with_a_script_error(tmp_path, lines) -> None:
    (tmp_path / "doc.txt").write_text("some text")
    with no_hang():
        try:
            ops = parse_script("\n".join(lines), tmp_path)
        except KvchatError as exc:
            assert str(exc) and "Traceback" not in str(exc)
            return
    assert ops  # an accepted script has something to run


# ------------------------------------------------------------------ GGUF headers


@dataclass(frozen=True)
class GGUFBytes:
    """A valid file's bytes (not printed when an example fails: they are long)."""

    data: bytes = field(repr=False)
    header_end: int
    dims_at: list[int] = field(repr=False)


@pytest.fixture(scope="module")
def gguf_bytes(tmp_path_factory) -> GGUFBytes:
    """A valid tiny GGUF's bytes, where its tensor data starts (the header's end), and
    where each tensor's dimensions are written in its tensor table."""
    path = write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", "Q4_1")
    data = path.read_bytes()
    with GGUFFile.open(path) as gguf:
        dims_at = []
        for name in gguf.tensors:
            encoded = name.encode()
            # the table entry: u64 name length, the name, u32 number of dims, u64 dims
            entry = data.rindex(struct.pack("<Q", len(encoded)) + encoded, 0, gguf.data_offset)
            dims_at.append(entry + 8 + len(encoded) + 4)
        return GGUFBytes(data, gguf.data_offset, dims_at)


U64_EDGES = [0, 1, 2**31, 2**32 - 1, 2**32, 2**63 - 1, 2**63, 2**64 - 1]


@st.composite
def broken_gguf(draw, original: bytes, header_end: int, dims_at: list[int]) -> bytes:
    data = bytearray(original)
    kind = draw(st.sampled_from(["truncate", "u64", "u32", "bytes", "dims"]))
    if kind == "truncate":
        return bytes(data[: draw(st.integers(0, len(data) - 1))])
    if kind == "dims":  # a tensor's shape overflowing, or not matching its bytes
        at = draw(st.sampled_from(dims_at)) + 8 * draw(st.integers(0, 1))
        data[at : at + 8] = struct.pack("<Q", draw(st.sampled_from(U64_EDGES[1:])))
        return bytes(data)
    at = draw(st.integers(4, header_end - 8))
    if kind == "u64":  # a length or a count: string lengths, array counts, dimensions
        data[at : at + 8] = struct.pack(
            "<Q", draw(st.sampled_from(U64_EDGES) | st.integers(0, 2**64 - 1))
        )
    elif kind == "u32":  # a value type, an element type, a number of dimensions
        data[at : at + 4] = struct.pack("<I", draw(st.integers(0, 2**32 - 1)))
    else:
        junk = draw(st.binary(min_size=1, max_size=16))
        data[at : at + len(junk)] = junk
    return bytes(data)


@FUZZ
@given(data=st.data())
def test_a_broken_gguf_header_is_a_clear_error(tmp_path, gguf_bytes, data) -> None:
    path = tmp_path / "broken.gguf"
    broken = broken_gguf(gguf_bytes.data, gguf_bytes.header_end, gguf_bytes.dims_at)
    path.write_bytes(data.draw(broken))
    with no_hang():
        try:
            with GGUFFile.open(path) as gguf:
                for info in gguf.tensors.values():
                    assert info.n_bytes >= 0 and len(gguf.raw(info.name)) == info.n_bytes
                gguf_to_hf_config(gguf)
                tokenizer_parts_from_gguf(gguf.metadata)
        except KvchatError as exc:
            assert str(exc)


# ------------------------------------------------------------------ safetensors headers


@dataclass(frozen=True)
class SafetensorsBytes:
    data: bytes = field(repr=False)


@pytest.fixture(scope="module")
def safetensors_bytes(tmp_path_factory) -> SafetensorsBytes:
    path = tmp_path_factory.mktemp("st") / "model.safetensors"
    g = torch.Generator().manual_seed(0)
    save_file(
        {"a.weight": torch.randn(8, 4, generator=g), "b.bias": torch.randn(8, generator=g)},
        str(path),
    )
    return SafetensorsBytes(path.read_bytes())


DTYPES = ["F32", "F16", "BF16", "I8", "U8", "F64", "Q4", "", "float32"]


@st.composite
def broken_safetensors(draw, original: bytes) -> bytes:
    (length,) = struct.unpack("<Q", original[:8])
    header = json.loads(original[8 : 8 + length])
    body = original[8 + length :]
    kind = draw(st.sampled_from(["truncate", "length", "dtype", "offsets", "shape", "json"]))
    if kind == "truncate":
        return original[: draw(st.integers(0, len(original) - 1))]
    if kind == "length":
        return struct.pack("<Q", draw(st.sampled_from(U64_EDGES))) + original[8:]
    name = draw(st.sampled_from(["a.weight", "b.bias"]))
    if kind == "dtype":
        header[name]["dtype"] = draw(st.sampled_from(DTYPES))
    elif kind == "offsets":
        header[name]["data_offsets"] = draw(
            st.lists(st.sampled_from(U64_EDGES[:6]) | st.integers(-5, 200), min_size=0, max_size=3)
        )
    elif kind == "shape":
        header[name]["shape"] = draw(st.lists(st.integers(-3, 2**40), max_size=3))
    else:
        text = json.dumps(header)
        cut = draw(st.integers(0, len(text)))
        encoded = text[:cut].encode() + draw(st.binary(max_size=4))
        return struct.pack("<Q", len(encoded)) + encoded + body
    encoded = json.dumps(header).encode()
    return struct.pack("<Q", len(encoded)) + encoded + body


@FUZZ
@given(data=st.data())
def test_a_broken_safetensors_header_is_a_clear_error(tmp_path, safetensors_bytes, data) -> None:
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    (folder / "model.safetensors").write_bytes(
        data.draw(broken_safetensors(safetensors_bytes.data))
    )
    with no_hang():
        try:
            tensors = dict(read_tensors(folder, torch.float32, torch.device("cpu")))
        except KvchatError as exc:
            assert "model.safetensors" in str(exc)
            return
    assert set(tensors) <= {"a.weight", "b.bias"}


def test_a_tensor_whose_shape_overflows_is_refused(tmp_path, gguf_bytes) -> None:
    dims_at = gguf_bytes.dims_at
    data = bytearray(gguf_bytes.data)
    # 2**62 x 4 elements: 2**64, which wraps to 0 in 64-bit arithmetic
    data[dims_at[0] : dims_at[0] + 16] = struct.pack("<QQ", 2**62, 4)
    path = tmp_path / "overflow.gguf"
    path.write_bytes(bytes(data))
    with pytest.raises(KvchatError, match=r"overflow\.gguf"):
        GGUFFile.open(path)


def test_the_fixtures_are_valid_before_they_are_broken(tmp_path, gguf_bytes, safetensors_bytes):
    path = tmp_path / "ok.gguf"
    path.write_bytes(gguf_bytes.data)
    with GGUFFile.open(path) as gguf:
        assert gguf_to_hf_config(gguf)["num_hidden_layers"] >= 1
    folder = tmp_path / "st"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(safetensors_bytes.data)
    assert set(dict(read_tensors(folder, torch.float32, torch.device("cpu")))) == {
        "a.weight",
        "b.bias",
    }
