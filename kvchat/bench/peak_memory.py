"""Peak resident memory of the processes a bench run measures, read the way each allows.

A speed figure says little without the memory it took, and the engines differ most
there (a dequantized copy of the weights, a server's slots), so every engine process
the bench runs gets its peak resident set beside its speed. Three readings:

- the bench's own process, where kvchat runs beside every in-process peer
  (transformers, llama-cpp-python): `getrusage(RUSAGE_SELF).ru_maxrss`, its high-water
  mark since it started. Those engines share one figure, which counts every model the
  process loaded; no per-engine share of it is made up.
- a child the bench runs to its end (llama-bench): `VmHWM` of `/proc/PID/status`, read
  while it runs. Not its rusage: Linux carries the high-water mark of the process a
  child is started from (vfork or fork) across the exec, so a child's `ru_maxrss` is
  never below the bench's own peak.
- a server the bench starts and stops (llama-server, vLLM): `VmHWM` of
  `/proc/PID/status`, read while it runs, for every process of its process group, added
  (vLLM keeps the model in an engine-core child). Processes of the group that already
  exited are not counted.

Linux gives ru_maxrss in KiB and VmHWM in kB (also KiB); both are returned in bytes.
A reading is a high-water mark, so a sample taken late still sees an earlier peak; only
what a child adds in its last sampling interval, or a server process that already
exited, goes unseen.
"""

from __future__ import annotations

import resource
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

BENCH_PROCESS = "bench"  # the process name of engines that run inside the bench's own
SAMPLE_S = 0.05  # how often a running child's high-water mark is read


@dataclass(frozen=True)
class PeakRss:
    """One engine's peak resident memory, and which process it is the peak of."""

    bytes: int
    process: str  # BENCH_PROCESS, or the child's own name ("llama-bench", "llama-server")
    shared: bool  # the bench's own process: every in-process engine has the same figure

    def to_json(self) -> dict:
        return {"bytes": self.bytes, "process": self.process, "shared": self.shared}


def own_peak() -> int:
    """The bench process's peak resident memory so far, in bytes."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def bench_peak() -> PeakRss:
    """The bench process's peak, as every in-process engine reports it."""
    return PeakRss(own_peak(), BENCH_PROCESS, shared=True)


def status_peak(pid: int) -> int | None:
    """`VmHWM` of a live process, in bytes; None once it is gone (or has no memory)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text(encoding="utf-8")
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return None  # a zombie, or a kernel thread


def group_peak(pgid: int) -> int | None:
    """The peaks of every live process in process group `pgid`, added; None when none
    of them is left."""
    total, found = 0, False
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text(encoding="utf-8")
        except OSError:
            continue  # exited while listed
        # pid (comm) state ppid pgrp ...: the name may hold spaces and parentheses
        if int(stat.rsplit(")", 1)[1].split()[2]) != pgid:
            continue
        peak = status_peak(int(entry.name))
        if peak is not None:
            total, found = total + peak, True
    return total if found else None


@dataclass(frozen=True)
class Finished:
    """A child run to its end: its exit code, its output and its own peak memory."""

    returncode: int
    stdout: str
    stderr: str
    peak_bytes: int  # its VmHWM at the last reading; 0 when it ended before the first


def run_measured(
    argv: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float
) -> Finished:
    """Run `argv` to its end, reading its peak memory (`VmHWM`) every `SAMPLE_S` while
    it runs; its output goes to temporary files, which never fill as a pipe would. Past
    `timeout` seconds it is killed and `subprocess.TimeoutExpired` raised."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        process = subprocess.Popen(argv, stdout=out, stderr=err, env=env)
        deadline = time.monotonic() + timeout
        peak = 0
        while process.poll() is None:  # running: its /proc entry is its own image's
            peak = max(peak, status_peak(process.pid) or 0)
            if time.monotonic() > deadline:
                process.kill()
                process.wait()
                raise subprocess.TimeoutExpired(list(argv), timeout)
            time.sleep(SAMPLE_S)
        out.seek(0)
        err.seek(0)
        return Finished(
            process.returncode,
            out.read().decode("utf-8", errors="replace"),
            err.read().decode("utf-8", errors="replace"),
            peak,
        )


def engine_peak(peer: object) -> PeakRss | None:
    """An engine's peak: a peer that runs its own process says it (`peak_rss`, None when
    it has none to say); any other runs in the bench's process and shares its figure."""
    own = getattr(peer, "peak_rss", None)
    return own() if callable(own) else bench_peak()
