"""llama-cpp-python with one context, as llama-server with one slot behaves.

This is the setup of a llama-server user with one slot: one context shared by every
conversation, each request re-rendered to text and re-tokenized whole, and only the
prefix it shares with the context's previous tokens reused (`Llama.generate` with
`reset=True` keeps that prefix and evaluates the rest). Switching conversation therefore
re-prefills the whole history. It runs on the default model's own GGUF (its native 4-bit
weights), so its speed is not the same-dtype comparison the transformers peer gives; the
report says so.

Gotchas (docs/benchmarks.md, "Peers"): `Llama` defaults to half the cores, so the thread counts are
set to torch's; end-of-sequence is "ignored" by pulling exactly N tokens from the
`generate` iterator (no logit bias, which would silently drop with a logits
processor).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvchat.bench.peers.base import (
    BatchResult,
    NotApplicable,
    PeerUnavailable,
    SpeedMeasured,
    TurnResult,
)
from kvchat.engine.token_ids import common_prefix

GREEDY = dict(top_k=1, top_p=1.0, min_p=0.0, typical_p=1.0, temp=0.0, repeat_penalty=1.0)
INSTALL_HINT = (
    'install it with: CMAKE_ARGS="-DGGML_NATIVE=ON" pip install llama-cpp-python '
    "(builds from source, a few minutes)"
)


@dataclass
class _Session:
    messages: list[dict[str, str]] = field(default_factory=list)
    seen: int = 0


class LlamaCppChat:
    """Every session shares the one context, as requests share llama-server's one slot."""

    def __init__(self, peer: LlamaCppPeer) -> None:
        self.peer = peer
        peer.llm.reset()

    def new_session(self) -> _Session:
        return _Session()

    def turn(self, session: object, text: str, max_tokens: int) -> TurnResult:
        assert isinstance(session, _Session)
        llm = self.peer.llm
        start = time.perf_counter()
        messages = [*session.messages, {"role": "user", "content": text}]
        tokens = self.peer.encode_chat(messages)
        held = llm._input_ids.tolist()  # what the context holds now
        reused = common_prefix(held, tokens[:-1])  # as Llama.generate decides it
        first, generated = self.peer.generate(tokens, max_tokens)
        end = time.perf_counter()
        reply = llm.detokenize(generated).decode("utf-8", errors="ignore")
        session.messages = [*messages, {"role": "assistant", "content": reply}]
        new = len(tokens) - session.seen
        session.seen = len(tokens) + len(generated)
        return TurnResult(
            first - start, end - start, len(tokens), len(tokens) - reused, new, len(generated)
        )

    def close(self) -> None:
        pass


class LlamaCppPeer(SpeedMeasured):
    name = "llama.cpp"

    def __init__(self, kvchat_model, progress=lambda _m: None) -> None:
        source = Path(kvchat_model.source)
        if not (source.is_file() and source.suffix.lower() == ".gguf"):
            raise PeerUnavailable(
                "llama.cpp needs a GGUF model; this model is a Hugging Face folder "
                f"({source}). Run the bench on the default model or a GGUF file."
            )
        try:
            import llama_cpp
        except ImportError as exc:
            raise PeerUnavailable(f"llama-cpp-python is not installed ({INSTALL_HINT})") from exc
        threads = torch.get_num_threads()
        n_ctx = min(kvchat_model.context_length, 8192)
        no_repack = cpu_has_amx()
        progress(f"Loading llama.cpp ({llama_cpp.__version__}) from {source.name}...")
        try:
            with _extra_buffer_types(enabled=not no_repack):
                self.llm = llama_cpp.Llama(
                    model_path=str(source),
                    n_ctx=n_ctx,
                    n_threads=threads,
                    n_threads_batch=threads,
                    verbose=False,
                )
        except (ValueError, RuntimeError, OSError) as exc:
            raise PeerUnavailable(f"llama.cpp could not load {source.name}: {exc}") from exc
        self.kvchat_model = kvchat_model
        self.template = kvchat_model.renderer.template
        self.source = source
        self.version = llama_cpp.__version__
        self.description = (
            f"llama-cpp-python {self.version}, {source.name} (its own quantized weights), "
            f"one context of {n_ctx} tokens, {threads} threads"
            + (", --no-repack (its AMX path crashes on this CPU)" if no_repack else "")
        )

    def encode_chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Render the model's template to text and tokenize it whole, as llama-server does."""
        text = self.template.render(messages, add_generation_prompt=True)
        tok = self.kvchat_model.tokenizer
        add_bos = bool(tok.add_bos_token and not text.startswith(tok.bos_token or "\0"))
        return self.llm.tokenize(text.encode("utf-8"), add_bos=add_bos, special=True)

    def generate(self, tokens: Sequence[int], max_tokens: int) -> tuple[float, list[int]]:
        """Greedy, exactly `max_tokens` tokens (EOS ignored); (first token time, ids)."""
        first = 0.0
        out: list[int] = []
        for token in self.llm.generate(list(tokens), reset=True, **GREEDY):
            if not out:
                first = time.perf_counter()
            out.append(int(token))
            if len(out) >= max_tokens:
                break
        return first, out

    def chat(self, capacity_tokens: int) -> LlamaCppChat:
        return LlamaCppChat(self)

    def _prefill_seconds(self, ids: Sequence[int]) -> float:
        self.llm.reset()
        start = time.perf_counter()
        self.llm.eval(list(ids))
        return time.perf_counter() - start

    def _decode_span(self, ids: Sequence[int], tokens: int) -> tuple[float, float, int]:
        self.llm.reset()
        first, out = self.generate(ids, tokens)
        end = time.perf_counter()
        self.llm.reset()
        return first, end, len(out)

    def batch(self, prompts: Sequence[Sequence[int]], tokens_each: int) -> BatchResult:
        raise NotApplicable(
            "one context serves one request at a time (as llama-server with one slot)"
        )

    def weight_bytes(self) -> int:
        return self.source.stat().st_size

    def close(self) -> None:
        close = getattr(self.llm, "close", None)
        if close is not None:
            close()


def cpu_has_amx() -> bool:
    """Whether the CPU advertises AMX, whose llama.cpp matmul path crashes here (0.3.36)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return any(line.startswith("flags") and "amx_int8" in line for line in f)
    except OSError:
        return False


@contextlib.contextmanager
def _extra_buffer_types(*, enabled: bool) -> Iterator[None]:
    """llama-server's `--no-repack`, which llama-cpp-python's `Llama` does not expose.

    On a CPU with AMX, llama.cpp puts weights in an AMX "extra buffer type" whose
    matmul segfaults in ggml's AMX kernel (seen with the Q4_1 default model). The
    switch is a field of the model parameters that `Llama.__init__` reads from
    `llama_model_default_params()`, so that function is wrapped while it runs.
    """
    if enabled:
        yield
        return
    import llama_cpp.llama_cpp as low

    original = low.llama_model_default_params

    def without_extra():
        params = original()
        params.use_extra_bufts = False
        return params

    low.llama_model_default_params = without_extra
    try:
        yield
    finally:
        low.llama_model_default_params = original
