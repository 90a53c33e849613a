"""kvchat's CPU attention kernel: compiled once on this machine, loaded into torch.

Why compile at all: on a CPU, torch's flash attention needs each sequence's K/V as
one strided tensor and gives each (sequence, kv head) pair to one thread, so a long
decode ran on one core per kv head and a paged context was copied before every
layer. `native/paged_attention.cpp` reads K/V in place through the page lists and
spreads even a single long decode over every core (see its header).

Why at first use rather than in the wheel: `-march=native` fits the kernel to the
CPU it runs on, and a pure-Python wheel installs everywhere. The build takes ~15 s
with the system C++ compiler against torch's own headers, runs in the background
(attention uses torch's SDPA until it is loaded), and is cached under the cache
folder keyed by the source, torch, the compiler and the CPU. Without a compiler, or
if anything fails, kvchat keeps using SDPA, says why on its start-up line
(`summary()`), and never fails a request for it.

`KVCHAT_NATIVE_ATTENTION=0` turns it off.
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

SOURCE = Path(__file__).parent / "native" / "paged_attention.cpp"
LIBRARY_NAME = "kvchat_attention.so"
DISABLE_ENV = "KVCHAT_NATIVE_ATTENTION"
HEAD_DIMS = (16, 64, 128)  # head sizes the kernel is compiled for (16: the tests' tiny models)
DTYPES = (torch.bfloat16, torch.float32)


@dataclass(frozen=True)
class KernelStatus:
    """Whether the kernel is in use, and if not, why (for a status line)."""

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


def _flags(torch_dir: Path) -> list[str]:
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    return [
        "-O3",
        "-march=native",
        "-ffast-math",  # vectorized exp and reductions; the kernel never makes inf or NaN
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
    """Where the build for this source, torch, compiler, flags and CPU is cached."""
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=30
    ).stdout
    key = hashlib.sha256()
    flags = " ".join(_flags(Path(torch.__file__).parent))
    for part in (SOURCE.read_bytes().decode(), torch.__version__, version, flags, _cpu_signature()):
        key.update(part.encode())
    return app_paths().cache_dir / "native" / key.hexdigest()[:16] / LIBRARY_NAME


def build(compiler: str, target: Path) -> None:
    """Compile the kernel to `target` (atomically: a crash never leaves half a library)."""
    torch_dir = Path(torch.__file__).parent
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    try:
        cmd = [compiler, *_flags(torch_dir), str(SOURCE), "-o", tmp, "-lc10", "-ltorch_cpu"]
        if sys.platform.startswith("linux"):
            cmd.append("-lmvec")  # glibc's vector math (exp) that -ffast-math calls into
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
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
            log.info("compiling the attention kernel to %s", target)
            build(compiler, target)
        torch.ops.load_library(str(target))
        with _State.lock:
            _State.loaded = True
            _State.detail = f"native kernel ({target})"
    except Exception as exc:  # any failure leaves SDPA in use, with the reason kept
        log.warning("native attention unavailable, using torch SDPA: %s", exc)
        with _State.lock:
            _State.detail = f"torch SDPA (native kernel unavailable: {exc})"


def disabled() -> bool:
    return os.environ.get(DISABLE_ENV, "1").strip().lower() in ("0", "false", "no", "off")


def request(wait: bool = False) -> None:
    """Start loading the kernel (in the background unless `wait`); idempotent."""
    if sys.platform == "win32" or disabled():
        with _State.lock:
            _State.detail = "torch SDPA (native kernel turned off)"
        return
    with _State.lock:
        if _State.loaded:
            return
        thread = _State.building
        if thread is None:
            thread = threading.Thread(target=_build_and_load, name="kvchat-kernel", daemon=True)
            _State.building = thread
            _State.detail = "compiling the native kernel"
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
            return "torch SDPA until kvchat's kernel is compiled (once, ~15 s)"
        return _State.detail


def supports(dtype: torch.dtype, head_dim: int, device: torch.device) -> bool:
    """Whether the loaded kernel serves this model's attention."""
    return _State.loaded and device.type == "cpu" and dtype in DTYPES and head_dim in HEAD_DIMS


def paged_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    pages: torch.Tensor,
    page_starts: torch.Tensor,
    q_starts: torch.Tensor,
    ctx_lens: torch.Tensor,
    page_size: int,
    scale: float,
) -> torch.Tensor:
    """Causal attention of every sequence's new tokens over its paged context.

    q `[T, Hq, D]` (sequences' new tokens back to back, `q_starts` `[B+1]` their
    offsets); k/v `[slots, Hkv, D]` one layer's store with slot = page * page_size +
    offset (int8 with per-slot, per-head scales `[slots, Hkv]`); sequence b's pages
    are `pages[page_starts[b]:page_starts[b+1]]`, its context `ctx_lens[b]` tokens,
    the last of them its new tokens.
    """
    return torch.ops.kvchat.paged_attention(
        q, k, v, k_scale, v_scale, pages, page_starts, q_starts, ctx_lens, page_size, scale
    )
