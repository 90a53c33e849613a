"""A reply that fills the device cache says so (not "the prompt does not fit"), and the TUI
shows an error message whole, wrapped under the message's header."""

from __future__ import annotations

import pytest

from kvchat.engine.events import RequestFinished
from kvchat.engine.request import FinishReason, GenerationRequest
from kvchat.model.loader import load_model
from kvchat.testing.tui import fake_app, ready, wait_until
from tests.engine_helpers import Collector, small_engine
from tests.tui_helpers import transcript_texts


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.tiny_models import write_tiny_model

    folder = write_tiny_model(tmp_path_factory.mktemp("tiny"), "llama")
    return load_model(str(folder), dtype="float32", device="cpu")


def run(tiny, prompt: list[int], max_tokens: int) -> RequestFinished:
    per_token = 2 * tiny.config.num_layers * tiny.config.num_kv_heads * tiny.config.head_dim * 4
    with small_engine(tiny, device_cache_bytes=4 * 16 * per_token, host_cache_bytes=0) as engine:
        collector = Collector()
        engine.submit(
            GenerationRequest(tuple(prompt), max_tokens=max_tokens, ignore_eos=True), collector
        )
        return collector.wait()


def test_a_reply_that_fills_the_device_cache_says_what_happened_and_what_to_do(tiny) -> None:
    finished = run(tiny, list(range(3, 13)), max_tokens=500)
    assert finished.reason == FinishReason.ERROR
    assert len(finished.generated_ids) > 40  # it ran until the cache was full
    assert "The reply reached the device cache's capacity" in finished.error
    assert "10 prompt tokens" in finished.error and "all 64 tokens" in finished.error
    assert "--device-cache" in finished.error and "max tokens" in finished.error
    assert "prompt does not fit" not in finished.error


LONG_ERROR = (
    "The reply reached the device cache's capacity: its 45 prompt tokens and 499 generated "
    "tokens fill all 544 tokens the device cache holds, so it stopped here (the text so far "
    "is kept). To go on, raise --device-cache, or lower the reply's max tokens. END-OF-MESSAGE"
)


async def test_the_tui_shows_a_long_error_whole() -> None:
    app, _ = fake_app(error_after_tokens=3, error_message=LONG_ERROR)
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot, app)
        await pilot.press(*"hi", "enter")
        await wait_until(pilot, lambda: transcript_texts(app)[-1:] != [] and
                         transcript_texts(app)[-1][1] == "error", what="the error")  # fmt: skip
        await pilot.pause()
        header = app.chat.transcript.blocks()[-1].header
        assert header.size.height >= 2  # wrapped, not cut at the transcript's edge
        shown = " ".join(app.export_screenshot().replace("&#160;", " ").split())
        assert "END-OF-MESSAGE" in shown


def test_a_prompt_that_can_never_fit_names_a_device_cache_that_holds_it(tiny) -> None:
    """The size the message names is enough: the same prompt is answered with it."""
    import re

    prompt = list(range(3, 103))  # 100 tokens against a cache of 64
    finished = run(tiny, prompt, max_tokens=4)
    assert finished.reason == FinishReason.ERROR
    assert "does not fit in the device cache" in finished.error
    named = re.search(r"--device-cache (\d+)MiB", finished.error)
    assert named, finished.error
    assert "edit the last message" in finished.error
    with small_engine(
        tiny, device_cache_bytes=int(named.group(1)) << 20, host_cache_bytes=0
    ) as engine:
        collector = Collector()
        engine.submit(GenerationRequest(tuple(prompt), max_tokens=4, ignore_eos=True), collector)
        assert collector.wait().reason != FinishReason.ERROR


def test_a_device_cache_smaller_than_the_context_is_announced_at_start(tiny) -> None:
    from kvchat.runtime import small_cache_notice

    per_token = 2 * tiny.config.num_layers * tiny.config.num_kv_heads * tiny.config.head_dim * 4
    with small_engine(tiny, device_cache_bytes=4 * 16 * per_token, host_cache_bytes=0) as engine:
        notice = small_cache_notice(engine)
        assert notice is not None and "holds 64 tokens" in notice, notice
        assert f"context ({engine.context_length:,})" in notice
        assert "--device-cache " in notice
    whole = engine.context_length * per_token
    with small_engine(tiny, device_cache_bytes=whole + 16 * per_token) as engine:
        assert small_cache_notice(engine) is None


async def test_the_tui_shows_the_start_notices_as_warnings() -> None:
    app, _ = fake_app(notices=("The device cache holds 64 tokens, fewer than the context",))
    async with app.run_test(size=(120, 40)) as pilot:
        await ready(pilot, app)
        await wait_until(
            pilot,
            lambda: any("holds 64 tokens" in n.message for n in app._notifications),
            what="the notice",
        )
        notice = next(n for n in app._notifications if "holds 64 tokens" in n.message)
        assert notice.severity == "warning"


def test_a_context_size_caps_what_a_conversation_holds_and_is_shown(tiny) -> None:
    """--context-size: the engine's context is the smaller of it and the model's; a prompt
    over it is refused saying so; the start-up line shows it; one over the model's is
    capped with a notice."""
    from kvchat.runtime import RuntimeOptions, context_notice, describe_cache

    with small_engine(tiny, context_tokens=512) as engine:
        assert engine.context_length == 512
        assert "context 512 tokens" in describe_cache(engine)
        collector = Collector()
        engine.submit(GenerationRequest(tuple(range(3, 603)), max_tokens=4), collector)
        finished = collector.wait()
        assert finished.reason == FinishReason.ERROR and "context holds 512" in finished.error
        options = RuntimeOptions(None, None, None, None, None, 16, None, None, None)
        assert context_notice(engine, options) is None
    with small_engine(tiny, context_tokens=10**6) as engine:
        assert engine.context_length == tiny.config.max_position_embeddings
        big = RuntimeOptions(
            None, None, None, None, None, 16, None, None, None, context_size=10**6,
            sources={"context_size": "--context-size"},
        )  # fmt: skip
        notice = context_notice(engine, big)
        assert notice is not None and "more than the model's context" in notice


async def test_a_failed_reply_names_the_retry_key_and_ctrl_r_tries_again() -> None:
    """The error says what to change; once changed (here: the engine stops failing, as a
    lower max tokens or a freed cache would make it), ctrl+r writes the reply again."""
    app, engine = fake_app(error_after_tokens=2, error_message="the cache is full")
    async with app.run_test(size=(150, 45)) as pilot:
        await ready(pilot, app)
        await pilot.press(*"hi", "enter")
        await wait_until(pilot, lambda: transcript_texts(app)[-1:] != [] and
                         transcript_texts(app)[-1][1] == "error", what="the error")  # fmt: skip
        header = str(app.chat.transcript.blocks()[-1].header.render())
        assert "the cache is full" in header and "(ctrl+r tries again)" in header
        assert "tries again" not in str(app.chat.transcript.blocks()[0].header.render())
        engine.error_after_tokens = None
        await pilot.press("ctrl+r")
        await wait_until(pilot, lambda: transcript_texts(app)[-1][1] == "complete", what="retried")
        assert [t[0] for t in transcript_texts(app)] == ["user", "assistant"]
        assert "tries again" not in str(app.chat.transcript.blocks()[-1].header.render())
