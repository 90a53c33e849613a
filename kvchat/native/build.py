"""kvchat's CPU kernels: compiled once on this machine, loaded into torch as `torch.ops.kvchat`.

Three sources live here: paged attention for decode steps (`paged_attention.cpp`, whose
header says why torch's own leaves cores and bandwidth unused there), a decoder layer's
small ops fused (`decoder_ops.cpp`: residual add + RMSNorm, rotary, SiLU * up), which
cut a decode step's op dispatches by two thirds, and 4-bit / 8-bit weight matrices
times float32 activations (`quantized_matmul.cpp`), which torch runs as a reference
loop (docs/kernels.md has the figures).

Why compile at first use rather than ship binaries: `-march=native` fits the kernels
to the CPU they run on, and a pure-Python wheel installs everywhere. The build takes
~15 s with the system C++ compiler against torch's own headers and is cached under the
cache folder keyed by the sources, torch, the compiler, the flags and the CPU. It runs
as a detached process at nice 10 (`compile_job.py`), so it completes even when
the command that started it was a two-second `kvchat ask`, never runs twice at once
for one cache folder, and leaves nothing but the library behind. Until the library is
there, torch's kernels serve, and a thread here loads it the moment it appears. Without
a compiler, or if anything fails, kvchat keeps torch's kernels, says why on its start-up
line (`summary()`), and never fails a request for it; a failed build is retried an hour
later, or at once after the compiler, torch or kvchat changes.

`KVCHAT_NATIVE_KERNELS=0` turns them off. `KVCHAT_KERNEL_ARCH` names the `-march`
target (default `native`; `x86-64-v3` builds what an AVX2 laptop would run, for tests
and the bench on a bigger CPU). `KVCHAT_KERNEL_CACHE` names the folder the builds are
kept in (default: `native/` in kvchat's cache folder), so that several kvchat folders
(a test run's, CI's) can share one build.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import platform
import re
import shutil
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from kvchat.native import compile_job
from kvchat.paths import app_paths

log = logging.getLogger(__name__)

SOURCE_NAMES = ("paged_attention.cpp", "decoder_ops.cpp", "quantized_matmul.cpp")
SOURCES = tuple(Path(__file__).parent / name for name in SOURCE_NAMES)
HEADERS = (Path(__file__).parent / "element_types.h",)  # included by the sources
LIBRARY_NAME = "kvchat_kernels.so"
DISABLE_ENV = "KVCHAT_NATIVE_KERNELS"
ARCH_ENV = "KVCHAT_KERNEL_ARCH"
CACHE_ENV = "KVCHAT_KERNEL_CACHE"
RETRY_FAILED_AFTER_S = 3600.0
POLL_S = 0.2


@dataclass(frozen=True)
class KernelStatus:
    """Whether the kernels are in use, and if not, why (for a status line)."""

    loaded: bool
    detail: str


@dataclass(frozen=True)
class BuildPlan:
    """What the detached compile job runs: everything decided here, so it needs no torch."""

    target: str
    compiler: str
    sources: tuple[str, ...]
    compile_flags: tuple[str, ...]
    link_flags: tuple[str, ...]
    link_extras: tuple[tuple[str, ...], ...]


class _State:
    lock = threading.Lock()
    loaded = False
    isa = ""
    since: float | None = None  # when the build this process waits for started
    building: threading.Thread | None = None
    detail = "not requested"


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _cpuinfo_line(*prefixes: str) -> str | None:
    """The first /proc/cpuinfo line starting with one of `prefixes` (None: no such line,
    or no /proc/cpuinfo)."""
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as f:
            for line in f:
                if line.startswith(prefixes):
                    return line
    except OSError:
        pass
    return None


def _cpu_signature() -> str:
    """The CPU's feature flags, so a cache folder shared by two machines never mixes
    kernels built with `-march=native` for different CPUs."""
    return _cpuinfo_line("flags", "Features") or platform.processor() or platform.machine()


def cpu_vendor() -> str:
    """The CPU's vendor as /proc/cpuinfo names it (GenuineIntel, AuthenticAMD; empty where
    it cannot be read)."""
    line = _cpuinfo_line("vendor_id")
    return line.partition(":")[2].strip() if line else ""


def stream_rows(vendor: str) -> int:
    """Weight rows the quantized decode loop streams at once (`quantized_matmul.cpp`): one
    on AMD's cores, which read one sequential stream fastest, four elsewhere (two where
    the build is AVX2's; measured on each: docs/kernels.md)."""
    return 1 if vendor == "AuthenticAMD" else 4


def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags as /proc/cpuinfo names them (empty where it cannot be read):
    which kernel is fastest for a shape depends on them (`native_attention`)."""
    line = _cpu_signature()
    _, _, names = line.partition(":")
    return frozenset(names.split())


def kernel_cache() -> Path:
    """The folder the builds are kept in, one subfolder a build key."""
    chosen = os.environ.get(CACHE_ENV, "").strip()
    return Path(chosen).expanduser() if chosen else app_paths().cache_dir / "native"


def target_arch() -> str:
    """The `-march` the kernels are compiled for: `KVCHAT_KERNEL_ARCH`, else native."""
    arch = os.environ.get(ARCH_ENV, "").strip() or "native"
    if not re.fullmatch(r"[A-Za-z0-9._-]+", arch):
        raise RuntimeError(f"{ARCH_ENV}={arch!r} is not a -march name (try native or x86-64-v3)")
    return arch


def _compile_flags(torch_dir: Path) -> list[str]:
    abi = int(getattr(torch._C, "_GLIBCXX_USE_CXX11_ABI", True))
    return [
        "-O3",
        f"-march={target_arch()}",
        "-ffast-math",  # vectorized reductions; the kernels never make inf or NaN
        "-std=c++20",
        "-fopenmp",  # at::parallel_for is OpenMP in torch builds; joins torch's own pool
        "-fPIC",
        "-w",
        f"-DKVCHAT_STREAM_ROWS={stream_rows(cpu_vendor())}",
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        f"-I{torch_dir / 'include'}",
        f"-I{torch_dir / 'include' / 'torch' / 'csrc' / 'api' / 'include'}",
    ]


def _link_flags(torch_dir: Path) -> list[str]:
    return [
        "-shared",
        "-fopenmp",
        f"-L{torch_dir / 'lib'}",
        f"-Wl,-rpath,{torch_dir / 'lib'}",
        "-lc10",
        "-ltorch_cpu",
    ]


def plan_build(compiler: str) -> BuildPlan:
    """The build for these sources, torch, compiler, flags and CPU, and where it is cached.

    On glibc, `-ffast-math` may turn a loop of `std::exp` (the portable path) into calls
    to glibc's vector math library, so it is linked when present; without it (musl),
    the link is retried without.
    """
    version = subprocess.run(
        [compiler, "--version"], capture_output=True, text=True, timeout=30
    ).stdout
    torch_dir = Path(torch.__file__).parent
    compile_flags, link_flags = _compile_flags(torch_dir), _link_flags(torch_dir)
    key = hashlib.sha256()
    sources = "".join(path.read_text() for path in (*SOURCES, *HEADERS))
    flags = " ".join([*compile_flags, *link_flags])
    for part in (sources, torch.__version__, version, flags, _cpu_signature()):
        key.update(part.encode())
    target = kernel_cache() / key.hexdigest()[:16] / LIBRARY_NAME
    extras = (("-lmvec",), ()) if sys.platform.startswith("linux") else ((),)
    return BuildPlan(
        str(target),
        compiler,
        tuple(map(str, SOURCES)),
        tuple(compile_flags),
        tuple(link_flags),
        extras,
    )


def library_path(compiler: str) -> Path:
    """Where the build for these sources, torch, compiler, flags and CPU is cached."""
    return Path(plan_build(compiler).target)


def start_build(plan: BuildPlan) -> subprocess.Popen:
    """Start the compile job detached: its own session, no terminal, niced."""
    return subprocess.Popen(
        [sys.executable, compile_job.__file__, json.dumps(asdict(plan))],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        close_fds=True,
    )


def _build_running(folder: Path) -> bool:
    """Whether a compile job holds this folder's lock now (ours or another process's)."""
    try:
        with open(folder / compile_job.LOCK_NAME, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return False
    except BlockingIOError:
        return True
    except OSError:
        return False


def _build_started(folder: Path) -> float | None:
    """When the build running in `folder` started (another process's, perhaps long
    before this one's), as its compile job wrote it in the lock file."""
    if not _build_running(folder):
        return None
    with contextlib.suppress(OSError, ValueError, IndexError):
        return float((folder / compile_job.LOCK_NAME).read_text().split()[0])
    return None


def _failure(target: Path) -> str | None:
    with contextlib.suppress(OSError):
        return (target.parent / compile_job.ERROR_NAME).read_text().strip()
    return None


def _recent_failure(target: Path) -> str | None:
    error = target.parent / compile_job.ERROR_NAME
    with contextlib.suppress(OSError):
        if time.time() - error.stat().st_mtime < RETRY_FAILED_AFTER_S:
            return _failure(target)
    return None


def _wait_for(target: Path, job: subprocess.Popen | None) -> None:
    """Until the library exists or no build of it runs any more."""
    while not target.exists():
        ours_running = job is not None and job.poll() is None
        if not ours_running and not _build_running(target.parent):
            return
        time.sleep(POLL_S)


def _load(target: Path) -> None:
    """Load the library; one that does not load (damaged, or built against another
    torch) is removed, so that the next start builds it anew."""
    try:
        torch.ops.load_library(str(target))
    except OSError:
        target.unlink(missing_ok=True)
        raise
    isa = torch.ops.kvchat.quantized_matmul_isa()
    with _State.lock:
        _State.loaded = True
        _State.isa = isa
        _State.detail = f"kvchat's CPU kernels, {isa} ({target})"


def _obtain() -> None:
    """Load the cached library, or start its build and load it when it is done."""
    try:
        compiler = _compiler()
        if compiler is None:
            raise RuntimeError("no C++ compiler found (install g++ or clang++, or set CXX)")
        plan = plan_build(compiler)
        target = Path(plan.target)
        compile_job.sweep(target.parent)  # what a killed build left, unless one runs now
        if not target.exists():
            failure = _recent_failure(target)
            if failure is not None:
                raise RuntimeError(failure)
            target.parent.mkdir(parents=True, exist_ok=True)
            log.info("compiling kvchat's kernels to %s", target)
            job = start_build(plan)
            with _State.lock:
                _State.since = _build_started(target.parent) or time.time()
            _wait_for(target, job)
            if not target.exists():
                raise RuntimeError(_failure(target) or "the kernel build failed")
        _load(target)
    except Exception as exc:  # any failure leaves torch's kernels in use, with the reason kept
        log.warning("kvchat's kernels unavailable, using torch's: %s", exc)
        with _State.lock:
            _State.detail = f"torch SDPA (kvchat's kernels unavailable: {exc})"


def disabled() -> bool:
    return os.environ.get(DISABLE_ENV, "1").strip().lower() in ("0", "false", "no", "off")


def request(wait: bool = False) -> None:
    """Load the kernels, building them first if needed (in the background unless
    `wait`); idempotent."""
    if sys.platform == "win32" or disabled():
        with _State.lock:
            _State.detail = "torch SDPA (kvchat's kernels turned off)"
        return
    with _State.lock:
        if _State.loaded:
            return
        thread = _State.building
        if thread is None:
            thread = threading.Thread(target=_obtain, name="kvchat-kernels", daemon=True)
            _State.building = thread
            _State.detail = "compiling kvchat's kernels"
            thread.start()
    if wait:
        thread.join()


def loaded() -> bool:
    return _State.loaded


def status() -> KernelStatus:
    with _State.lock:
        return KernelStatus(_State.loaded, _State.detail)


def summary(device: torch.device) -> str:
    """A few words for the start-up line: which attention serves this engine, and which
    vector instructions kvchat's kernels were built for."""
    if device.type != "cpu":
        return "torch SDPA"
    with _State.lock:
        if _State.loaded:
            return f"kvchat's CPU kernels ({_State.isa})"
        if _State.building is not None and _State.building.is_alive():
            if _State.since is None:
                return "torch SDPA while kvchat's kernels load"
            started = time.strftime("%H:%M:%S", time.localtime(_State.since))
            return (
                f"torch SDPA while kvchat's kernels compile (once, in the background, "
                f"since {started}; about 15 s)"
            )
        return _State.detail
