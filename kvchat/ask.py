"""`kvchat ask QUESTION`: one answer streamed to stdout, for smoke tests and shell scripts.

Greedy unless `--temperature` says otherwise, like the headless mode, so the same
question gives the same answer. Progress and cache sizes go to stderr; stdout gets
only the answer.
"""

from __future__ import annotations

import argparse
import sys
import threading
from collections.abc import Callable

from kvchat.engine.api import (
    EngineEvent,
    FinishReason,
    GenerationRequest,
    RequestFinished,
    TokenGenerated,
)
from kvchat.errors import KvchatError, UsageError
from kvchat.remote.options import remote_options
from kvchat.runtime import (
    describe_cache,
    open_chat_backend,
    read_settings,
    resolve_options,
)


def run_ask(args: argparse.Namespace) -> int:
    if not args.question.strip():
        raise UsageError(
            'the question is empty; ask something, like kvchat ask "What is a KV cache?"'
        )
    settings = read_settings()
    options = resolve_options(args, settings)

    def progress(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    remote = remote_options(args, settings)
    backend = open_chat_backend(options, settings, progress, greedy=True, remote=remote)
    engine = backend.chat.engine
    messages = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    messages.append({"role": "user", "content": args.question})
    max_tokens = options.max_tokens or 512
    if remote is not None:  # one turn through the server's `TurnPort`
        from kvchat.chat.engine_port import Turn

        turn = Turn("ask", tuple(messages), (), backend.sampling, max_tokens)
        return _stream_answer(engine, lambda on_event: engine.submit_turn(turn, on_event))
    progress(describe_cache(engine))
    prompt = backend.chat.renderer.prompt_ids(messages)
    if len(prompt) + 1 >= engine.context_length:
        engine.close()
        raise KvchatError(
            f"The question is {len(prompt)} tokens long but the model's context holds "
            f"{engine.context_length}; shorten it."
        )
    request = GenerationRequest(tuple(prompt), backend.sampling, max_tokens)
    return _stream_answer(engine, lambda on_event: engine.submit(request, on_event))


def _stream_answer(engine, submit: Callable[[Callable[[EngineEvent], None]], int]) -> int:
    """Print the answer as it streams; ctrl+c cancels it; the engine is closed at the end."""
    done = threading.Event()
    result: list[RequestFinished] = []

    def on_event(event: EngineEvent) -> None:
        if isinstance(event, TokenGenerated) and event.text:
            sys.stdout.write(event.text)
            sys.stdout.flush()
        elif isinstance(event, RequestFinished):
            result.append(event)
            done.set()

    request_id = submit(on_event)
    try:
        while not done.wait(0.2):
            pass
    except KeyboardInterrupt:
        engine.cancel(request_id)
        done.wait(10)
    finally:
        engine.close()
    sys.stdout.write("\n")
    finished = result[0] if result else None
    if finished is None or finished.reason == FinishReason.CANCELLED:
        print("kvchat: generation cancelled", file=sys.stderr)
        return 130
    if finished.reason == FinishReason.ERROR:
        raise KvchatError(finished.error or "generation failed")
    return 0
