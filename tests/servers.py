"""Real serving engines for the remote-engine tests: built or installed once, started per run.

llama-server is built from the llama.cpp sources vendored in the
llama-cpp-python sdist and vLLM's CPU build installed into its own venv, both
in the servers cache outside the checkout (kvchat/testing/servers_dir.py;
benchmarks/servers/ holds the scripts, which `.ci/run` also calls so their time
is printed apart). The Hugging Face folder vLLM serves is written once into the
test cache beside the default model (tests/shared_cache.py); the build logs and
the servers' logs go to a temporary folder of the test run's own. A server
listens on a free 127.0.0.1 port, is ready when its health/models endpoint
answers, and is stopped by its PID. When the build or install itself is
impossible the tests that need it are skipped with the reason printed.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.shared_cache import TEST_CACHE

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "benchmarks" / "servers"
SERVED_NAME = "smollm2"


@functools.cache
def logs_dir() -> Path:
    """This test run's folder for build and server logs (test runs share the cache)."""
    return Path(tempfile.mkdtemp(prefix="kvchat-server-logs-"))


class Unavailable(Exception):
    """The server cannot be built, installed or started on this machine (the reason)."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_script(name: str, log_name: str, *args: str, env: dict[str, str] | None = None) -> Path:
    log = logs_dir() / log_name
    with log.open("w") as err:
        done = subprocess.run(
            ["bash", str(SCRIPTS / name), *args],
            stdout=subprocess.PIPE,
            stderr=err,
            text=True,
            env={**os.environ, **(env or {})},
        )
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        tail = log.read_text(errors="replace").strip().splitlines()[-3:]
        raise Unavailable(f"{name} failed (see {log}): " + " | ".join(tail))
    return Path(lines[-1])


def llama_server_binary(cpu: str = "native") -> Path:
    """llama-server built for this CPU, or for an AVX2 laptop's features (`cpu="avx2"`),
    with llama-bench and llama-quantize beside it."""
    return _run_script(
        "build_llama_server.sh", f"llama-build-{cpu}.log", env={"KVCHAT_LLAMA_CPU": cpu}
    )


def vllm_python() -> Path:
    return _run_script("install_vllm.sh", "vllm-install.log")


def vllm_model_folder(gguf: Path) -> Path:
    out = TEST_CACHE / "vllm-models" / gguf.name.split(".")[0]
    # in a child process: transformers' memory is not kept by the test run
    code = "import sys\nfrom kvchat.bench.peers.hf_folder import hf_folder_of\n"
    code += "hf_folder_of(*sys.argv[1:])"
    done = subprocess.run(
        [sys.executable, "-c", code, str(gguf), str(out)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    if done.returncode != 0:
        raise Unavailable(f"could not write the model folder for vLLM: {done.stderr[-300:]}")
    return out


@dataclass
class Server:
    """A running server process on 127.0.0.1."""

    kind: str  # "llama-server" | "vllm"
    port: int
    process: subprocess.Popen
    log: Path
    model: str = SERVED_NAME
    api_key: str | None = None
    argv: list[str] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def url(self) -> str:
        return self.root + "/v1"

    def alive(self) -> bool:
        return self.process.poll() is None

    def stop(self) -> None:
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(10)

    def restart(self) -> None:
        self.stop()
        self.process = _spawn(self.argv, self.env, self.log)
        _wait_ready(self)


def _spawn(argv: list[str], env: dict[str, str], log: Path) -> subprocess.Popen:
    out = log.open("ab")
    # its own process group, so stopping it stops the workers it forks (vLLM's engine core)
    return subprocess.Popen(
        argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
    )


def _wait_ready(server: Server, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    headers = {"Authorization": f"Bearer {server.api_key}"} if server.api_key else {}
    while time.monotonic() < deadline:
        if not server.alive():
            tail = server.log.read_text(errors="replace").strip().splitlines()[-5:]
            raise Unavailable(f"{server.kind} exited at start: " + " | ".join(tail))
        try:
            request = urllib.request.Request(server.url + "/models", headers=headers)
            with urllib.request.urlopen(request, timeout=5) as response:
                if response.status == 200 and json.load(response).get("data"):
                    return
        except (urllib.error.URLError, OSError, ValueError):
            pass
        time.sleep(0.5)
    server.stop()
    raise Unavailable(f"{server.kind} was not ready after {timeout_s:.0f} s (see {server.log})")


def start_llama_server(
    gguf: Path, *, api_key: str | None = None, slots: int = 4, ctx: int = 32768
) -> Server:
    binary = llama_server_binary()
    port = free_port()
    argv = [
        str(binary),
        *("-m", str(gguf), "--host", "127.0.0.1", "--port", str(port)),
        *("-np", str(slots), "-c", str(ctx), "--metrics", "--slots", "-t", "2"),
        *("--alias", SERVED_NAME),
    ]
    if api_key:
        argv += ["--api-key", api_key]
    env = dict(os.environ, LD_LIBRARY_PATH=str(binary.parent))
    log = logs_dir() / f"llama-server-{port}.log"
    server = Server("llama-server", port, _spawn(argv, env, log), log, api_key=api_key)
    server.argv, server.env = argv, env
    _wait_ready(server)
    return server


def start_vllm(gguf: Path, *, max_model_len: int = 8192) -> Server:
    python = vllm_python()
    folder = vllm_model_folder(gguf)
    port = free_port()
    argv = [
        str(python),
        *("-m", "vllm.entrypoints.openai.api_server", "--model", str(folder)),
        *("--host", "127.0.0.1", "--port", str(port), "--served-model-name", SERVED_NAME),
        *("--enable-prefix-caching", "--enable-prompt-tokens-details", "--enforce-eager"),
        *("--max-model-len", str(max_model_len), "--dtype", "bfloat16"),
    ]
    env = dict(
        os.environ,
        HF_HUB_OFFLINE="1",
        VLLM_CPU_KVCACHE_SPACE="2",
        VLLM_CPU_OMP_THREADS_BIND=os.environ.get("VLLM_CPU_OMP_THREADS_BIND", "0-1"),
    )
    log = logs_dir() / f"vllm-{port}.log"
    server = Server("vllm", port, _spawn(argv, env, log), log)
    server.argv, server.env = argv, env
    _wait_ready(server)
    return server


# ----------------------------------------------------------------- fixtures
# Imported by tests/conftest.py; each server starts once per test run.


@pytest.fixture(scope="session")
def llama_server(default_gguf_path):
    try:
        server = start_llama_server(default_gguf_path)
    except Unavailable as exc:
        pytest.skip(f"llama-server cannot be built or started here: {exc}")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def vllm_server(default_gguf_path):
    try:
        server = start_vllm(default_gguf_path)
    except Unavailable as exc:
        pytest.skip(f"vLLM cannot be installed or started here: {exc}")
    yield server
    server.stop()
