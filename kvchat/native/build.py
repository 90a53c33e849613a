"""kvchat's CPU kernels: compiled once on this machine, loaded into torch as `torch.ops.kvchat`.

Two sources live here: paged attention for decode steps (`paged_attention.cpp`, whose
header says why torch's own leaves cores and bandwidth unused there), and a decoder
layer's small ops fused (`decoder_ops.cpp`: residual add + RMSNorm, rotary, SiLU * up),
which cut a decode step's op dispatches by two thirds. A 4-bit
matrix-vector kernel (AVX-512 VNNI, int16 activations) was built and measured next to
it: 1.6-1.8x torch's int4 kernel per matrix in isolation, but no faster in a real
decode step, which streams the same bytes either way; so it was not kept.

Why compile at first use rather than ship binaries: `-march=native` fits the kernels
to the CPU they run on, and a pure-Python wheel installs everywhere. The build takes
~15 s with the system C++ compiler against torch's own headers, runs in the background
(torch's own kernels serve until it is loaded), and is cached under the cache folder
keyed by the sources, torch, the compiler, the flags and the CPU. Without a compiler,
or if anything fails, kvchat keeps torch's kernels, says why on its start-up line
(`summary()`), and never fails a request for it.

`KVCHAT_NATIVE_KERNELS=0` turns them off.
"""

from __future__ import annotations

import hashlib
import logging
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass
from pathlib import Path

import torch

from kvchat.paths import app_paths

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).parent / name for name in ("paged_attention.cpp", "decoder_ops.cpp"))
HEADERS = (Path(__file__).parent / "element_types.h",)  # included by the sources
LIBRARY_NAME = "kvchat_kernels.so"
DISABLE_ENV = "KVCHAT_NATIVE_KERNELS"


@dataclass(frozen=True)
class KernelStatus:
    """Whether the kernels are in use, and if not, why (for a status line)."""

    loaded: bool
    detail: str


class _State:
    lock = threading.Lock()
    loaded = False
    building: threading.Thread | None = None
    detail = "not requested"


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _cpu_signature() -> str:
    """The CPU's feature flags, so a cache folder shared by two machines never mixes
    kernels built with `-march=native` for different CPUs."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    return line
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo names them (empty where it cannot be read):
    which kernel is fastest for a shape depends on them (`native_attention`)."""
    line = _cpu_signature()
    _, _, names = line.partition(":")
    return frozenset(names.split())


def _flags(torch_dir: Path) -> list[str]:
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    return [
        "-O3",
        "-march=native",
        "-ffast-math",  # vectorized reductions; the kernels never make inf or NaN
        "-std=c++20",
        "-fopenmp",  # at::parallel_for is OpenMP in torch builds; joins torch's own pool
        "-fPIC",
        "-shared",
        "-w",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        f"-I{torch_dir / 'include'}",
        f"-I{torch_dir / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
        f"-L{torch_dir / 'lib'}",
        f"-Wl,-rpath,{torch_dir / 'lib'}",
    ]


def library_path(compiler: str) -> Path:
    """Where the build for these sources, torch, compiler, flags and CPU is cached."""
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=30
    ).stdout
    key = hashlib.sha256()
    flags = " ".join(_flags(Path(torch.__file__).parent))
    sources = "".join(path.read_text() for path in (*SOURCES, *HEADERS))
    for part in (sources, torch.__version__, version, flags, _cpu_signature()):
        key.update(part.encode())
    return app_paths().cache_dir / "native" / key.hexdigest()[:16] / LIBRARY_NAME


def build(compiler: str, target: Path) -> None:
    """Compile the kernels to `target` (atomically: a crash never leaves half a library).

    On glibc, `-ffast-math` may turn a loop of `std::exp` (the portable path) into calls
    to glibc's vector math library, so it is linked when present; without it (musl),
    the build is retried without.
    """
    torch_dir = Path(torch.__file__).parent
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        cmd = [compiler, *_flags(torch_dir), *map(str, SOURCES), "-o", tmp, "-lc10", "-ltorch_cpu"]
        extras = [["-lmvec"], []] if sys.platform.startswith("linux") else [[]]
        for extra in extras:
            done = subprocess.run([*cmd, *extra], capture_output=True, text=True, timeout=900)
            if done.returncode == 0:
                break
        if done.returncode != 0:
            raise RuntimeError(done.stderr.strip()[-2000:] or "compiler failed")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def _build_and_load() -> None:
    try:
        compiler = _compiler()
        if compiler is None:
            raise RuntimeError("no C++ compiler found (install g++ or clang++, or set CXX)")
        target = library_path(compiler)
        if not target.exists():
            log.info("compiling kvchat's kernels to %s", target)
            build(compiler, target)
        torch.ops.load_library(str(target))
        with _State.lock:
            _State.loaded = True
            _State.detail = f"kvchat's CPU kernel ({target})"
    except Exception as exc:  # any failure leaves torch's kernels in use, with the reason kept
        log.warning("kvchat's kernels unavailable, using torch's: %s", exc)
        with _State.lock:
            _State.detail = f"torch SDPA (kvchat's kernel unavailable: {exc})"


def disabled() -> bool:
    return os.environ.get(DISABLE_ENV, "1").strip().lower() in ("0", "false", "no", "off")


def request(wait: bool = False) -> None:
    """Start loading the kernels (in the background unless `wait`); idempotent."""
    if sys.platform == "win32" or disabled():
        with _State.lock:
            _State.detail = "torch SDPA (kvchat's kernel turned off)"
        return
    with _State.lock:
        if _State.loaded:
            return
        thread = _State.building
        if thread is None:
            thread = threading.Thread(target=_build_and_load, name="kvchat-kernels", daemon=True)
            _State.building = thread
            _State.detail = "compiling kvchat's kernel"
            thread.start()
    if wait:
        thread.join()


def loaded() -> bool:
    return _State.loaded


def status() -> KernelStatus:
    with _State.lock:
        return KernelStatus(_State.loaded, _State.detail)


def summary(device: torch.device) -> str:
    """A few words for the start-up line: which attention serves this engine."""
    if device.type != "cpu":
        return "torch SDPA"
    with _State.lock:
        if _State.loaded:
            return "kvchat's CPU kernel"
        if _State.building is not None and _State.building.is_alive():
            return "torch SDPA while kvchat's kernel compiles (once, ~15 s)"
        return _State.detail
