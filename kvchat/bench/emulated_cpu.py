"""`kvchat bench --cpu avx2`: the bench on an AVX2-class CPU, emulated on a bigger one.

Most users' CPUs have AVX2 and no AVX-512 or native bf16, where kvchat computes in
float32; a bench machine usually has more. The settings that make torch and kvchat
behave as on such a CPU must be in the environment before torch loads, so the bench
starts itself again with them: kvchat's kernels compiled for x86-64-v3, oneDNN capped
at AVX2 (it then reports no native bf16, and kvchat picks float32), ATen's kernels and
MKL's (torch's float32 matrix products) at AVX2. The report's machine line says so.
The llama.cpp peer of such a run is one built for AVX2 only
(`KVCHAT_LLAMA_CPU=avx2 benchmarks/servers/build_llama_server.sh`, `--llama-server`);
llama-bench comes from that build too (`llama_cpp_tools.find_llama_bench`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from kvchat.errors import UsageError

CPUS = ("native", "avx2")
EMULATED_AVX2 = {
    "KVCHAT_KERNEL_ARCH": "x86-64-v3",
    "ONEDNN_MAX_CPU_ISA": "AVX2",
    "ATEN_CPU_CAPABILITY": "avx2",
    "MKL_ENABLE_INSTRUCTIONS": "AVX2",
}
MARK = "KVCHAT_EMULATED_CPU"  # set in the restarted bench: the CPU it emulates


def emulated_cpu() -> str | None:
    """The CPU this process emulates ("avx2"), None on the machine's own."""
    return os.environ.get(MARK) or None


def restart_emulating(cpu: str, argv: Sequence[str]) -> None:
    """For `--cpu avx2`, replace this process by the same command under the emulating
    environment (returns only when there is nothing to do)."""
    if cpu not in CPUS:
        raise UsageError(f"--cpu is one of {', '.join(CPUS)}, not {cpu!r}.")
    if cpu == "native" or emulated_cpu() == cpu:
        return
    if "avx2" not in _cpu_flags():
        raise UsageError("--cpu avx2 emulates an AVX2 CPU on a bigger one; this CPU has no AVX2.")
    env = {**os.environ, **EMULATED_AVX2, MARK: cpu}
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "kvchat", *argv], env)


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()
