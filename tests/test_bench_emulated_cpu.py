"""`kvchat bench --cpu avx2`: the bench restarts itself under the settings of an AVX2
CPU, once, and its report says which CPU it emulated."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvchat.bench import emulated_cpu
from kvchat.bench.machine import machine_line
from kvchat.errors import UsageError


class Restarted(Exception):
    pass


@pytest.fixture
def execve(monkeypatch) -> list:
    calls: list = []

    def fake(path, argv, env):
        calls.append((path, argv, env))
        raise Restarted

    monkeypatch.setattr(emulated_cpu.os, "execve", fake)
    monkeypatch.delenv(emulated_cpu.MARK, raising=False)
    return calls


def test_avx2_restarts_the_same_command_under_the_emulating_settings(execve, monkeypatch):
    monkeypatch.setattr(emulated_cpu, "_cpu_flags", lambda: {"avx2", "avx512f"})
    with pytest.raises(Restarted):
        emulated_cpu.restart_emulating("avx2", ["bench", "--cpu", "avx2", "--quick"])
    ((_path, argv, env),) = execve
    assert argv == [sys.executable, "-m", "kvchat", "bench", "--cpu", "avx2", "--quick"]
    assert env[emulated_cpu.MARK] == "avx2"
    assert env["ONEDNN_MAX_CPU_ISA"] == "AVX2" and env["MKL_ENABLE_INSTRUCTIONS"] == "AVX2"
    assert env["KVCHAT_KERNEL_ARCH"] == "x86-64-v3" and env["ATEN_CPU_CAPABILITY"] == "avx2"


def test_the_restarted_bench_and_native_runs_go_on(execve, monkeypatch):
    emulated_cpu.restart_emulating("native", ["bench"])
    monkeypatch.setenv(emulated_cpu.MARK, "avx2")
    emulated_cpu.restart_emulating("avx2", ["bench", "--cpu", "avx2"])
    assert execve == []


def test_a_cpu_without_avx2_is_told_so(execve, monkeypatch):
    monkeypatch.setattr(emulated_cpu, "_cpu_flags", lambda: {"sse4_2"})
    with pytest.raises(UsageError, match="no AVX2"):
        emulated_cpu.restart_emulating("avx2", ["bench", "--cpu", "avx2"])


def test_the_machine_line_names_the_emulated_cpu():
    info = {"cpu": "Xeon", "cores": 2, "torch_threads": 2, "torch": "2.13", "python": "3.11"}
    info |= {"device": "cpu", "dtype": "float32"}
    assert "emulating" not in machine_line(info)
    assert "Xeon emulating an AVX2 CPU (`--cpu avx2`)" in machine_line(
        info | {"emulated_cpu": "avx2"}
    )


@pytest.mark.skipif("avx2" not in emulated_cpu._cpu_flags(), reason="needs an AVX2 CPU")
def test_a_quick_speed_run_on_the_emulated_cpu_computes_in_float32(tmp_path, tiny_llama_dir):
    out = tmp_path / "out"
    command = ["bench", "--cpu", "avx2", "--quick", "--workloads", "speed", "--peers", "none"]
    command += ["--model", str(tiny_llama_dir), "--out", str(out)]
    done = subprocess.run(
        [sys.executable, "-m", "kvchat", *command],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads((out / "bench.json").read_text())
    machine = json.dumps(results)
    assert '"emulated_cpu": "avx2"' in machine and '"dtype": "float32"' in machine
    assert "emulating an AVX2 CPU" in (out / "bench.md").read_text()
