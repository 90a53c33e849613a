"""llama-bench as llama.cpp's speed peer: its JSON read into the speed workload's figures,
the build picked for the CPU the bench runs on, and the real llama-bench run by the bench
on the same made GGUF kvchat loads (the tiny shape), natively and on an emulated AVX2 CPU.

The real runs skip, with the reason, only where llama.cpp cannot be built here, as the
llama-server tests do. Timings are only checked to be positive: this machine is shared.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvchat.bench.llama_cpp_tools import build_simd, find_llama_bench, simd_stamp
from kvchat.bench.peers.llama_bench import LlamaBenchRow, parse_rows, speed_of
from kvchat.cli import main
from kvchat.errors import KvchatError
from kvchat.native.build import cpu_flags
from tests.shared_cache import TEST_CACHE

# two tests of llama-bench 0.3.36's `-o json`, trimmed of the fields the bench does not read
OUTPUT = """[
  {"build_commit": "0c1e570", "model_filename": "/m/tiny.gguf", "n_threads": 2,
   "n_prompt": 512, "n_gen": 0, "n_depth": 0, "avg_ns": 3700000000, "stddev_ns": 40000000,
   "avg_ts": 138.2, "stddev_ts": 1.5, "samples_ts": [137.1, 139.3]},
  {"build_commit": "0c1e570", "model_filename": "/m/tiny.gguf", "n_threads": 2,
   "n_prompt": 0, "n_gen": 128, "n_depth": 512, "avg_ns": 6900000000, "stddev_ns": 0,
   "avg_ts": 18.6, "stddev_ts": 0.0, "samples_ts": [18.6]}
]"""


def test_llama_bench_json_is_read_into_one_row_per_test():
    rows = parse_rows(OUTPUT)
    assert rows == [LlamaBenchRow(512, 0, 0, 138.2, 1.5), LlamaBenchRow(0, 128, 512, 18.6, 0.0)]


@pytest.mark.parametrize("text", ["", '[{"n_prompt": 512}]', '{"error": 1}', "[1]"])
def test_llama_bench_output_that_is_not_its_json_is_an_error_that_quotes_it(text):
    with pytest.raises(KvchatError, match="llama-bench's JSON output could not be read"):
        parse_rows(text)


def test_speed_figures_are_pp_from_an_empty_context_and_tg_at_the_depth_and_at_zero():
    rows = [
        LlamaBenchRow(128, 0, 0, 900.0, 5.0),
        LlamaBenchRow(512, 0, 0, 700.0, 5.0),
        LlamaBenchRow(512, 0, 128, 1.0, 0.0),  # a pp test at a depth: not the prefill figure
        LlamaBenchRow(0, 16, 128, 80.0, 1.0),
        LlamaBenchRow(0, 16, 0, 95.0, 1.0),
        LlamaBenchRow(0, 32, 128, 2.0, 0.0),  # another decode length
    ]
    speed = speed_of(rows, (128, 512), decode_prompt=128, decode_tokens=16)
    assert speed.prefill_tok_s == {128: 900.0, 512: 700.0}
    assert (speed.decode_tok_s, speed.short_decode_tok_s) == (80.0, 95.0)
    with pytest.raises(KvchatError, match="no test of 0 prompt and 64 generated tokens"):
        speed_of(rows, (128,), decode_prompt=128, decode_tokens=64)


def test_an_avx2_stamp_keeps_only_an_avx2_laptops_features():
    flags = {"avx", "avx2", "fma", "f16c", "bmi2", "avx512f", "avx512_bf16", "amx_tile"}
    native, avx2 = simd_stamp(flags), simd_stamp(flags, "avx2")
    assert "-DGGML_AVX512=ON" in native and "-DGGML_AVX512_BF16=ON" in native
    assert "-DGGML_AVX2=ON" in avx2 and "-DGGML_AVX512=OFF" in avx2
    assert "AVX512_BF16=ON" not in avx2 and "-DGGML_AMX_TILE=OFF" in native


def _fake_build(folder: Path, stamp: str) -> Path:
    (folder / "bin").mkdir(parents=True)
    (folder / "bin" / "simd").write_text(stamp + "\n")
    for tool in ("llama-server", "llama-bench"):
        (folder / "bin" / tool).write_text("#!/bin/sh\n")
        (folder / "bin" / tool).chmod(0o755)
    return folder / "bin"


def test_llama_bench_comes_from_the_build_for_the_cpu_the_bench_runs_on(tmp_path, monkeypatch):
    flags = {"avx", "avx2", "fma", "f16c", "bmi2", "avx512f"}
    monkeypatch.setenv("KVCHAT_SERVERS_DIR", str(tmp_path))
    native = _fake_build(tmp_path / "llama-server-0.3.36-aaa", simd_stamp(flags))
    avx2 = _fake_build(tmp_path / "llama-server-0.3.36-bbb", simd_stamp(flags, "avx2"))
    assert find_llama_bench(None, flags) == native / "llama-bench"
    assert find_llama_bench(None, flags, "avx2") == avx2 / "llama-bench"
    # beside --llama-server: the llama-server peer's own build, the one the user picked
    assert find_llama_bench(avx2 / "llama-server", flags, "avx2") == avx2 / "llama-bench"
    assert find_llama_bench(native / "llama-server", flags) == native / "llama-bench"
    with pytest.raises(KvchatError, match=r"uses AVX-512.*KVCHAT_LLAMA_CPU=avx2"):
        find_llama_bench(native / "llama-server", flags, "avx2")
    (avx2 / "llama-bench").unlink()
    with pytest.raises(KvchatError, match=r"no llama\.cpp build for an AVX2 CPU"):
        find_llama_bench(None, flags, "avx2")
    with pytest.raises(KvchatError, match="no llama-bench beside llama-server"):
        find_llama_bench(avx2 / "llama-server", flags, "avx2")


def test_a_hugging_face_folder_has_no_llama_bench_and_the_report_says_why(tmp_path):
    from kvchat.bench.peers.base import PeerUnavailable
    from kvchat.bench.runner import _llama_bench_peer

    class Model:
        source = tmp_path / "tiny"

    with pytest.raises(PeerUnavailable, match="measures GGUF files"):
        _llama_bench_peer(None, Model())


def _build(cpu: str) -> Path:
    from tests.servers import Unavailable, llama_server_binary

    try:
        return llama_server_binary(cpu)
    except Unavailable as exc:
        pytest.skip(f"llama.cpp cannot be built here: {exc}")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory, default_gguf_path) -> Path:
    """The tiny shape in Q4_0, made once for the module as `--model-shape` makes it."""
    from kvchat.bench import model_maker
    from kvchat.bench.model_shapes import TINY_LLAMA

    server = _build("native")
    made = model_maker.make_shape(
        TINY_LLAMA,
        tmp_path_factory.mktemp("shapes"),
        default_gguf_path,
        lambda _m: None,
        llama_server=str(server),
        tools_cache=TEST_CACHE,
    )
    return made.gguf("Q4_0")


@pytest.mark.real_model
def test_the_native_build_is_stamped_as_the_bench_computes_it():
    server = _build("native")
    assert build_simd(server) == simd_stamp(cpu_flags())
    assert find_llama_bench(None, cpu_flags()) == server.parent / "llama-bench"


@pytest.mark.real_model
def test_speed_runs_llama_bench_on_the_file_kvchat_loads_beside_kvchat(tiny_gguf, tmp_path):
    import torch

    server = _build("native")
    out = tmp_path / "out"
    argv = ["bench", "--quick", "--model", str(tiny_gguf), "--workloads", "speed"]
    argv += ["--peers", "llama-bench", "--llama-server", str(server), "--out", str(out)]
    assert main(argv) == 0
    results = json.loads((out / "bench.json").read_text())
    speed = results["workloads"]["speed"]
    assert not speed["errors"], speed["errors"]
    assert {"kvchat", "llama-bench"} <= set(speed["engines"])
    median = speed["engines"]["llama-bench"]["median"]
    assert set(median["prefill_tok_s"]) == {str(n) for n in speed["prompt_lengths"]}
    assert all(v > 0 for v in median["prefill_tok_s"].values())
    assert median["decode_tok_s"] > 0 and median["short_decode_tok_s"] > 0
    # its share of the bandwidth bound is taken on the file it reads
    assert speed["engines"]["llama-bench"]["weight_bytes_per_token"] == tiny_gguf.stat().st_size
    description = results["engines"]["llama-bench"]
    assert tiny_gguf.name in description and f"{torch.get_num_threads()} threads" in description
    # its own peak memory, apart from the bench's process (which holds kvchat)
    peak = speed["engines"]["llama-bench"]["peak_rss"]
    assert peak["process"] == "llama-bench" and not peak["shared"]
    assert (
        tiny_gguf.stat().st_size < peak["bytes"] < speed["engines"]["kvchat"]["peak_rss"]["bytes"]
    )
    table = (out / "bench.md").read_text().split("## Speed", 1)[1].split("\n## ", 1)[0]
    assert "| llama-bench |" in table and "| kvchat |" in table
    assert "peak RSS (GiB)" in table


@pytest.mark.real_model
@pytest.mark.skipif("avx2" not in cpu_flags(), reason="needs an AVX2 CPU")
def test_an_emulated_avx2_run_takes_llama_bench_from_the_avx2_build(tiny_gguf, tmp_path):
    server = _build("avx2")
    assert "-DGGML_AVX512=OFF" in (build_simd(server) or "")
    out = tmp_path / "out"
    command = ["bench", "--cpu", "avx2", "--quick", "--workloads", "speed"]
    command += ["--peers", "llama-bench", "--model", str(tiny_gguf), "--out", str(out)]
    done = subprocess.run(
        [sys.executable, "-m", "kvchat", *command],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((out / "bench.json").read_text())
    assert results["machine"]["emulated_cpu"] == "avx2"
    assert "llama-bench" in results["workloads"]["speed"]["engines"], results["skipped"]
    assert f"({server.parent.parent.name}, AVX2 build)" in results["engines"]["llama-bench"]
