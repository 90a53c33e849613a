"""llama.cpp's own tools: the converter and quantizer for GGUFs the bench (and the tests)
make, and llama-bench, which measures llama.cpp's speed on them.

The bench measures model shapes no weights of which can be fetched here, as files made
the way a user's GGUF is made: `convert_hf_to_gguf.py` (with its `conversion/` package
and `gguf-py`) from the llama-cpp-python sdist the llama-server build uses
(`benchmarks/servers/build_llama_server.sh` pins the version), fetched once with pip
into a cache folder, then `llama-quantize`, built beside llama-server. llama-bench is
built beside them too; it must come from the build made for the CPU the bench runs
on (the native one, or the AVX2-only one under `--cpu avx2`), so it is looked up by
the SIMD features the build script stamps into each build (`bin/simd`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Set as AbstractSet
from pathlib import Path

from kvchat.errors import KvchatError
from kvchat.testing.servers_dir import servers_dir

VERSION = "0.3.36"  # as benchmarks/servers/build_llama_server.sh
_INSIDE = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
_WANTED = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
BUILD_SCRIPT = "benchmarks/servers/build_llama_server.sh"


# The build script's CPU-feature-to-CMake pairs and the features an AVX2 laptop has
# (benchmarks/servers/build_llama_server.sh): keep the three in sync.
_SIMD_PAIRS = (
    ("avx", "AVX"), ("avx2", "AVX2"), ("fma", "FMA"), ("f16c", "F16C"), ("bmi2", "BMI2"),
    ("avx512f", "AVX512"), ("avx512_vbmi", "AVX512_VBMI"), ("avx512_vnni", "AVX512_VNNI"),
    ("avx512_bf16", "AVX512_BF16"), ("avx_vnni", "AVX_VNNI"),
)  # fmt: skip
_AVX2_FEATURES = frozenset({"avx", "avx2", "fma", "f16c", "bmi2"})


class ConverterUnavailable(KvchatError):
    """The sdist could not be fetched (no network to PyPI): the reason."""


def converter_folder(cache: Path) -> Path:
    """Where `converter` keeps llama.cpp's converter under `cache`."""
    return cache / f"llama-cpp-convert-{VERSION}"


def converter(cache: Path) -> Path:
    """The folder holding convert_hf_to_gguf.py, conversion/ and gguf-py/ (fetched once
    into `cache`, whole or not at all)."""
    folder = converter_folder(cache)
    if (folder / "convert_hf_to_gguf.py").exists():
        return folder
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        got = subprocess.run(
            [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--no-binary", ":all:",
             f"llama-cpp-python=={VERSION}", "-d", scratch],
            capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        if got.returncode != 0:
            raise ConverterUnavailable(
                f"llama.cpp's converter could not be fetched from PyPI: {got.stderr[-500:]}"
            )
        (sdist,) = Path(scratch).glob("*.tar.gz")
        partial = Path(tempfile.mkdtemp(prefix=folder.name + ".", dir=cache))
        with tarfile.open(sdist) as tar:
            for member in tar.getmembers():
                inner = member.name.removeprefix(_INSIDE)
                if (
                    member.name.startswith(_INSIDE)
                    and inner.startswith(_WANTED)
                    and member.isfile()
                ):
                    member.name = inner
                    tar.extract(member, partial, filter="data")
        partial.rename(folder)
    return folder


# The converter, run as its own script once transformers is told to keep the tokenizer
# class a qwen2 or Qwen3.5-MoE folder declares (see `convert`).
_CONVERT = """
import runpy, sys
from transformers.models.auto import tokenization_auto
for kind in ("qwen2", "qwen3_5_moe_text"):
    getattr(tokenization_auto, "MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS", set()).discard(kind)
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def convert(
    hf_folder: Path, out: Path, outtype: str, cache: Path, options: tuple[str, ...] = ()
) -> Path:
    """`hf_folder` as a GGUF of `outtype` (f32, bf16, q8_0), as llama.cpp converts it
    (`options`: more of the converter's flags, e.g. `--no-mtp`).

    The folders converted here carry the default model's tokenizer (SmolLM2's byte-level
    BPE) under the class it was saved with, and the converter names the pre-tokenizer by a
    hash of what `AutoTokenizer` makes of the folder. For a few model types transformers
    overrides the declared class with its own; for qwen2 that is `Qwen2Tokenizer`, which
    rebuilds the tokenizer with Qwen's pre-tokenizer: SmolLM2's vocabulary split Qwen's way
    hashes to nothing the converter knows, and it refuses the folder; so for Qwen3.5-MoE's
    `qwen3_5_moe_text`. The converter, as it is, therefore runs with those two off
    transformers' list of overridden types, so their folders are read with their own
    class, as llama, qwen3, gemma3 and dense Qwen3.5 folders already are.
    """
    folder = converter(cache)
    env = {**os.environ, "PYTHONPATH": f"{folder / 'gguf-py'}{os.pathsep}{folder}"}
    done = subprocess.run(
        [sys.executable, "-c", _CONVERT, str(folder / "convert_hf_to_gguf.py"), str(hf_folder),
         "--outfile", str(out), "--outtype", outtype, *options],
        capture_output=True, text=True, timeout=3600, env=env,
    )  # fmt: skip
    if done.returncode != 0:
        raise KvchatError(f"llama.cpp's convert_hf_to_gguf.py failed:\n{done.stderr[-3000:]}")
    return out


def find_quantize(llama_server: str | Path | None = None) -> Path:
    """llama-quantize: beside the `llama_server` given, else in the servers cache's
    llama-server build; a message saying how to build it otherwise."""
    candidates = []
    if llama_server:
        candidates.append(Path(llama_server).parent / "llama-quantize")
    candidates += sorted(servers_dir().glob("llama-server-*/bin/llama-quantize"))
    for candidate in candidates:
        if candidate.is_file() and os.access(candidate, os.X_OK):
            return candidate
    raise KvchatError(
        f"llama-quantize was not found beside a llama-server build. Build it with {BUILD_SCRIPT} "
        "(it builds llama-server, llama-bench and llama-quantize into the servers cache), or "
        "pass --llama-server PATH of a build that has it beside."
    )


def quantize(source: Path, out: Path, qtype: str, binary: Path) -> Path:
    """`source` (an f32/bf16 GGUF) quantized to `qtype` (Q4_0, Q4_K_M, ...) by llama.cpp."""
    env = {**os.environ, "LD_LIBRARY_PATH": str(binary.parent)}
    done = subprocess.run(
        [str(binary), str(source), str(out), qtype, "2"],
        capture_output=True, text=True, timeout=3600, env=env,
    )  # fmt: skip
    if done.returncode != 0:
        raise KvchatError(f"llama-quantize failed ({qtype}):\n{done.stderr[-2000:]}")
    return out


def simd_stamp(cpu_flags: AbstractSet[str], cpu: str = "native") -> str:
    """The `bin/simd` line the build script writes for a build made on a CPU with
    `cpu_flags`, for that CPU ("native") or capped at an AVX2 laptop's features ("avx2")."""
    flags = cpu_flags & _AVX2_FEATURES if cpu == "avx2" else cpu_flags
    parts = ["-DGGML_NATIVE=OFF"]
    parts += [f"-DGGML_{name}={'ON' if flag in flags else 'OFF'}" for flag, name in _SIMD_PAIRS]
    parts += ["-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
    return " ".join(parts)


def build_simd(binary: Path) -> str | None:
    """The SIMD stamp of the build `binary` belongs to (None for a build made otherwise)."""
    try:
        return (binary.parent / "simd").read_text(encoding="utf-8").strip()
    except OSError:
        return None


def find_llama_bench(
    llama_server: str | Path | None, cpu_flags: AbstractSet[str], cpu: str = "native"
) -> Path:
    """llama-bench of the llama.cpp build the bench compares against on this CPU.

    Beside `llama_server` when one is given (the llama-server peer's own build, the one
    the user picked: for `--cpu avx2`, the AVX2-only one; a build with AVX-512 is refused
    there); else the servers cache's build made for this CPU (`cpu`: "native", or "avx2"
    for the emulated AVX2 CPU). A message saying how to build it otherwise.
    """
    wanted = simd_stamp(cpu_flags, cpu)
    how = ("KVCHAT_LLAMA_CPU=avx2 " if cpu == "avx2" else "") + BUILD_SCRIPT
    if llama_server:
        candidate = Path(llama_server).parent / "llama-bench"
        if not _runnable(candidate):
            raise KvchatError(
                f"no llama-bench beside {Path(llama_server).name} (--llama-server); "
                f"{how} builds it beside llama-server."
            )
        if cpu == "avx2" and "-DGGML_AVX512=ON" in (build_simd(candidate) or ""):
            raise KvchatError(
                "the llama.cpp build given with --llama-server uses AVX-512, which the "
                f"emulated AVX2 CPU has not; give the AVX2-only build ({how})."
            )
        return candidate
    for candidate in sorted(servers_dir().glob("llama-server-*/bin/llama-bench")):
        if _runnable(candidate) and build_simd(candidate) == wanted:
            return candidate
    cpu_name = "an AVX2 CPU" if cpu == "avx2" else "this CPU"
    raise KvchatError(
        f"no llama.cpp build for {cpu_name} in the servers cache ({servers_dir()}); build "
        f"one with {how} (it builds llama-server, llama-bench and llama-quantize), or "
        "pass --llama-server PATH of a build that has llama-bench beside."
    )


def _runnable(path: Path) -> bool:
    return path.is_file() and os.access(path, os.X_OK)
