"""llama.cpp's own converter and quantizer, for GGUFs the bench (and the tests) make.

The bench measures model shapes no weights of which can be fetched here, as files made
the way a user's GGUF is made: `convert_hf_to_gguf.py` (with its `conversion/` package
and `gguf-py`) from the llama-cpp-python sdist the llama-server build uses
(`benchmarks/servers/build_llama_server.sh` pins the version), fetched once with pip
into a cache folder, then `llama-quantize`, built beside llama-server.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from kvchat.errors import KvchatError
from kvchat.testing.servers_dir import servers_dir

VERSION = "0.3.36"  # as benchmarks/servers/build_llama_server.sh
_INSIDE = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
_WANTED = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")
BUILD_SCRIPT = "benchmarks/servers/build_llama_server.sh"


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


def convert(hf_folder: Path, out: Path, outtype: str, cache: Path) -> Path:
    """`hf_folder` as a GGUF of `outtype` (f32, bf16, q8_0), as llama.cpp converts it."""
    folder = converter(cache)
    env = {**os.environ, "PYTHONPATH": f"{folder / 'gguf-py'}{os.pathsep}{folder}"}
    done = subprocess.run(
        [sys.executable, str(folder / "convert_hf_to_gguf.py"), str(hf_folder),
         "--outfile", str(out), "--outtype", outtype],
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
