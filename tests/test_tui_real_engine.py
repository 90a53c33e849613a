"""End to end on the real engine with a tiny random model: the reply streams, the meters show hits.

This file may import torch (through the model and engine); `kvchat/tui/` may not.
"""

from __future__ import annotations

import re

from kvchat.chat.engine_port import ChatBackend
from kvchat.chat.store import Store
from kvchat.engine.config import EngineConfig
from kvchat.engine.engine import Engine
from kvchat.engine.request import SamplingParams
from kvchat.model.loader import load_model
from kvchat.testing.tui import ready, wait_until
from kvchat.tui.app import KvchatApp
from kvchat.tui.backend import TuiBackend
from tests.tui_helpers import transcript_texts


def tiny_backend(folder) -> TuiBackend:
    model = load_model(str(folder), dtype="float32", device="cpu")
    engine = Engine(
        model,
        EngineConfig(device_cache_bytes=16 << 20, host_cache_bytes=16 << 20, page_size=16),
    )
    return TuiBackend(
        chat=ChatBackend(engine, model.renderer, frozenset(model.tokenizer.stop_token_ids)),
        default_sampling=SamplingParams(temperature=0.0),
        default_max_tokens=300,
        description="tiny llama",
        close=engine.close,
    )


async def test_reply_streams_and_follow_up_turn_hits_the_cache(tiny_llama_dir):
    progress: list[str] = []

    def factory(report):
        report("loading the tiny model")
        progress.append("called")
        return tiny_backend(tiny_llama_dir)

    app = KvchatApp(factory, store_factory=Store.in_memory)
    async with app.run_test(size=(150, 40)) as pilot:
        await ready(pilot, app)
        assert progress == ["called"]
        streamed: list[tuple[str, int]] = []  # (state of the reply, characters shown) per flush
        append = app.chat.transcript.append

        async def watching_append(chunk):
            ok = await append(chunk)
            block = app.chat.transcript.block(chunk.message_id)
            streamed.append((str(block.message.state), block.shown))
            return ok

        app.chat.transcript.append = watching_append
        await pilot.press(*"hello there", "enter")
        await wait_until(
            pilot,
            lambda: len(transcript_texts(app)) == 2 and transcript_texts(app)[-1][1] == "complete",
            60,
            "the first reply",
        )
        assert transcript_texts(app)[-1][2] == app.service.messages(app.chat.current)[-1].content
        growing = [shown for state, shown in streamed if state == "streaming"]
        assert len(growing) >= 2 and growing == sorted(growing), streamed

        await pilot.press(*"tell me more", "enter")
        await wait_until(
            pilot,
            lambda: len(transcript_texts(app)) == 4 and transcript_texts(app)[-1][1] == "complete",
            60,
            "the follow-up reply",
        )
        app.chat.frames.tick_meters()
        shown = app.chat.meters.values["hit-rate"]
        last, overall = (int(x) for x in re.findall(r"(\d+)%", shown))
        assert last > 0 and overall > 0, shown
        assert app.chat.views[app.chat.current].last_turn.cached_tokens.total > 0
        pages = app.chat.meters.values["pages"]
        assert re.search(r"\d+/[1-9]\d*/\d+", pages), pages  # cached pages on the device
