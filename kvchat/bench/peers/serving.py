"""Serving engines as bench peers: llama-server and vLLM on 127.0.0.1, over the OpenAI API.

These are what a user would run instead of kvchat: llama-server with four slots
(or one: `llama-server-1slot`) and its RAM prompt cache, vLLM (its CPU build) with
prefix caching. The bench starts each one itself (`--llama-server PATH`,
`--vllm-python PATH`) on a free port, waits until it answers, and stops it by its
PID. A chat sends each session's whole conversation, as any OpenAI client does, and the server finds
the cached prefix; the turn's prefilled tokens are the prompt less the server's
own `cached_tokens`. Every chat starts with nothing cached: llama-server is
restarted (it starts in about a second), vLLM's prefix cache is reset.
TTFT is taken from the request to the first streamed text. A server's peak memory is
its process group's (`peak_memory.group_peak`), read before it is stopped; llama-server's
is the largest of its restarts'.

W2 (`concurrent`) streams one new conversation per question, all at once, with
the same request as a chat's first turn; the server batches them. llama-server
is started for it with a slot per conversation (`-np 8` for W2's eight), as a
user serving that many would start it. Each stream's tokens are the server's
`usage.completion_tokens`, and a stream that did not generate exactly the
tokens asked for fails the run rather than skew its figures.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvchat.bench.peak_memory import PeakRss, group_peak
from kvchat.bench.peers.base import (
    BatchResult,
    PeerUnavailable,
    TurnResult,
    batch_from_deltas,
    concurrent_on_fresh_chat,
)

SERVED_NAME = "bench"
READY_TIMEOUT_S = 600.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _Process:
    """A server process in its own process group, ready once `/v1/models` answers."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], port: int) -> None:
        self.name, self.port = name, port
        self.peak_seen = 0  # the largest peak of its process group read so far
        self.log = Path(tempfile.mkstemp(prefix=f"kvchat-bench-{name}-", suffix=".log")[1])
        with self.log.open("ab") as out:
            self.process = subprocess.Popen(
                argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )
        deadline = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = self.log.read_text(errors="replace").strip().splitlines()[-3:]
                raise PeerUnavailable(f"{name} exited at start: {' | '.join(tail)}")
            try:
                url = f"http://127.0.0.1:{port}/v1/models"
                with urllib.request.urlopen(url, timeout=5) as response:
                    if response.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            time.sleep(0.5)
        self.stop()
        raise PeerUnavailable(f"{name} was not ready after {READY_TIMEOUT_S:.0f} s")

    def peak_bytes(self) -> int:
        """The peak resident memory of its processes, added (the largest read while it ran)."""
        if self.process.poll() is None:
            self.peak_seen = max(self.peak_seen, group_peak(self.process.pid) or 0)
        return self.peak_seen

    def stop(self) -> None:
        if self.process.poll() is None:
            self.peak_bytes()  # while it still runs: a process that exited has no VmHWM
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(10)


@dataclass
class _Session:
    messages: list[dict[str, str]] = field(default_factory=list)
    seen: int = 0  # the previous turn's prompt + reply, in tokens


class ServerChat:
    """Sessions as an OpenAI client keeps them: the whole conversation every turn."""

    def __init__(self, port: int, model: str = SERVED_NAME) -> None:
        import openai

        self.model = model
        self.client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none")

    def new_session(self) -> _Session:
        return _Session()

    def _stream(self, messages: list[dict[str, str]], max_tokens: int):
        """A streamed reply of exactly `max_tokens` tokens: greedy, end of sequence ignored."""
        return self.client.chat.completions.create(
            model=self.model,
            messages=messages,
            stream=True,
            stream_options={"include_usage": True},
            max_tokens=max_tokens,
            temperature=0.0,
            extra_body={"ignore_eos": True},
        )

    def turn(self, session: object, text: str, max_tokens: int) -> TurnResult:
        assert isinstance(session, _Session)
        session.messages.append({"role": "user", "content": text})
        start = time.perf_counter()
        first: float | None = None
        parts: list[str] = []
        usage = None
        for chunk in self._stream(session.messages, max_tokens):
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                if choice.delta and choice.delta.content:
                    if first is None:
                        first = time.perf_counter()
                    parts.append(choice.delta.content)
        end = time.perf_counter()
        reply = "".join(parts)
        session.messages.append({"role": "assistant", "content": reply})
        prompt = int(getattr(usage, "prompt_tokens", 0) or 0)
        generated = int(getattr(usage, "completion_tokens", 0) or 0)
        details = getattr(usage, "prompt_tokens_details", None)
        cached = int(getattr(details, "cached_tokens", 0) or 0) if details else 0
        new = max(0, prompt - session.seen)
        session.seen = prompt + generated
        return TurnResult(
            ttft_s=(first or end) - start,
            total_s=end - start,
            prompt_tokens=prompt,
            prefilled_tokens=prompt - cached,
            new_tokens=new,
            generated_tokens=generated,
            text=reply,
        )

    def concurrent(self, questions: Sequence[str], tokens_each: int) -> BatchResult:
        """W2: one new conversation per question (as a chat's first turn), all streamed at
        once from their own threads; the server batches them."""
        deltas: list[list[float]] = [[] for _ in questions]
        generated = [0] * len(questions)
        failures: list[BaseException] = []

        def stream(i: int, text: str) -> None:
            try:
                for chunk in self._stream([{"role": "user", "content": text}], tokens_each):
                    if chunk.usage is not None:
                        generated[i] = int(chunk.usage.completion_tokens or 0)
                    if any(c.delta and c.delta.content for c in chunk.choices):
                        deltas[i].append(time.perf_counter())
            except Exception as exc:  # re-raised on the caller's thread
                failures.append(exc)

        threads = [
            threading.Thread(target=stream, args=(i, q), daemon=True)
            for i, q in enumerate(questions)
        ]
        start = time.perf_counter()
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        if failures:
            raise failures[0]
        short = [(i, n) for i, n in enumerate(generated) if n != tokens_each or not deltas[i]]
        if short:
            i, n = short[0]
            raise RuntimeError(
                f"W2 stream {i + 1} of {len(questions)} generated {n} tokens "
                f"({len(deltas[i])} text deltas), not {tokens_each}"
            )
        return batch_from_deltas(deltas, generated, tokens_each, start)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.client.close()


class _LlamaServer:
    """llama-server started by the bench with `slots` slots and its RAM prompt cache (on
    by default), restarted for every chat so that each starts with nothing cached."""

    name = "llama-server"
    slots = 4

    def __init__(self, binary: Path, gguf: Path, progress) -> None:
        if not binary.is_file():
            raise PeerUnavailable(f"no llama-server at {binary}")
        if gguf.suffix.lower() != ".gguf":
            raise PeerUnavailable("llama-server serves GGUF files; the model is not one")
        self.binary, self.gguf, self.progress = binary, gguf, progress
        self.description = f"llama-server -np {self.slots} (RAM prompt cache on), {gguf.name}"
        self.server: _Process | None = None
        self.peak_seen = 0  # the largest peak of the servers it stopped

    def chat(self, capacity_tokens: int, slots: int | None = None) -> ServerChat:
        self.close()  # a fresh chat: nothing cached
        slots = self.slots if slots is None else slots
        port = _free_port()
        ctx = max(32768, slots * capacity_tokens)  # the slots share the context
        argv = [
            str(self.binary),
            *("-m", str(self.gguf), "--host", "127.0.0.1", "--port", str(port)),
            *("-np", str(slots), "-c", str(ctx), "--alias", SERVED_NAME),
            *("-t", str(os.cpu_count() or 1)),
        ]
        env = dict(os.environ, LD_LIBRARY_PATH=str(self.binary.parent))
        self.server = _Process(self.name, argv, env, port)
        return ServerChat(port)

    def peak_rss(self) -> PeakRss | None:
        """The largest peak of the servers it started so far (None before the first)."""
        live = self.server.peak_bytes() if self.server is not None else 0
        peak = max(self.peak_seen, live)
        return PeakRss(peak, self.name, shared=False) if peak else None

    def close(self) -> None:
        if self.server is not None:
            self.server.stop()
            self.peak_seen = max(self.peak_seen, self.server.peak_seen)
            self.server = None


class LlamaServerPeer(_LlamaServer):
    """llama-server with 4 slots (`-np 4`, what it picks by itself) for the chats, and for
    W2 a slot per conversation."""

    def __init__(self, binary: Path, gguf: Path, progress) -> None:
        super().__init__(binary, gguf, progress)
        self.description = (
            f"llama-server -np 4 (RAM prompt cache on; W2: -np 8, a slot a session), {gguf.name}"
        )

    def concurrent(
        self, questions: Sequence[str], tokens_each: int, capacity_tokens: int
    ) -> BatchResult:
        """W2 on a fresh server with a slot per question, so none waits for a free one."""
        chat = self.chat(capacity_tokens, slots=len(questions))
        try:
            return chat.concurrent(questions, tokens_each)
        finally:
            chat.close()


class OneSlotLlamaServerPeer(_LlamaServer):
    """`llama-server-1slot`: the chats share one slot, as for a user who starts it with
    `-np 1`: a switch finds the slot holding another conversation, and only the RAM prompt
    cache can give the history back. No W2: concurrent streams are what slots are for."""

    name = "llama-server-1slot"
    slots = 1


class VllmPeer:
    """vLLM's CPU build with prefix caching, eager, bf16; started once, its cache reset per chat."""

    name = "vllm"

    def __init__(self, python: Path, model_folder: Path, progress) -> None:
        if not python.is_file():
            raise PeerUnavailable(f"no Python at {python}")
        progress("Starting vLLM for the bench (about a minute)...")
        self.port = _free_port()
        argv = [
            str(python),
            *("-m", "vllm.entrypoints.openai.api_server", "--model", str(model_folder)),
            *("--host", "127.0.0.1", "--port", str(self.port)),
            *("--served-model-name", SERVED_NAME, "--enable-prefix-caching"),
            *("--enable-prompt-tokens-details", "--enforce-eager", "--max-model-len", "8192"),
        ]
        env = dict(
            os.environ,
            HF_HUB_OFFLINE="1",
            VLLM_SERVER_DEV_MODE="1",  # for /reset_prefix_cache
            VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"),
        )
        self.server = _Process(self.name, argv, env, self.port)
        self.description = "vLLM (CPU build), prefix caching, bf16, eager"

    def chat(self, capacity_tokens: int) -> ServerChat:
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}/reset_prefix_cache", method="POST"
        )
        with contextlib.suppress(urllib.error.URLError, OSError):
            urllib.request.urlopen(request, timeout=30).close()
        return ServerChat(self.port)

    def concurrent(
        self, questions: Sequence[str], tokens_each: int, capacity_tokens: int
    ) -> BatchResult:
        """W2 on the running server, its prefix cache reset first as for a chat."""
        return concurrent_on_fresh_chat(self, questions, tokens_each, capacity_tokens)

    def peak_rss(self) -> PeakRss | None:
        """The peak of its processes, the engine core's included."""
        peak = self.server.peak_bytes()
        return PeakRss(peak, self.name, shared=False) if peak else None

    def close(self) -> None:
        self.server.stop()
