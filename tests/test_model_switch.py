"""Switching the model kvchat runs without a restart (the session layer's half): later
turns go to the new engine; sessions computed with the old model say so and render
their history again at their next turn; a switch while a reply is on the way is refused
with what to do; the TUI's picker (f5) lists the models and switches."""

from __future__ import annotations

import pytest

from kvchat.chat.service import MODEL_CHANGED_NOTICE, SessionService
from kvchat.chat.store import Store
from kvchat.errors import KvchatError
from kvchat.testing.fake_engine import CharRenderer, FakeEngine


def service_on(engine: FakeEngine) -> SessionService:
    renderer = CharRenderer()
    return SessionService(
        engine, renderer, Store.in_memory(), stop_token_ids=renderer.stop_token_ids
    )


def test_later_turns_run_on_the_new_engine_and_old_sessions_are_told():
    old, new = FakeEngine(fingerprint="model-a"), FakeEngine(fingerprint="model-b")
    service = service_on(old)
    try:
        talked = service.create_session()
        service.say(talked, "hello")
        assert service.wait_idle(talked, timeout=10)
        empty = service.create_session()
        service.replace_backend(new, CharRenderer(), stop_token_ids=CharRenderer().stop_token_ids)
        assert service.engine.model_fingerprint == "model-b"
        assert service.session(talked).notice == MODEL_CHANGED_NOTICE
        assert service.session(empty).notice is None
        submitted_before = len(new.submitted)
        service.say(talked, "again")
        assert service.wait_idle(talked, timeout=10)
        assert len(new.submitted) > submitted_before  # the new engine wrote the reply
        assert service.messages(talked)[-1].content  # and it was stored
    finally:
        service.close()


def test_a_switch_while_a_reply_is_on_the_way_is_refused():
    old = FakeEngine(fingerprint="model-a", manual=True)
    service = service_on(old)
    try:
        sid = service.create_session()
        service.say(sid, "hello")
        with pytest.raises(KvchatError, match="still have a reply on the way"):
            service.replace_backend(FakeEngine(fingerprint="model-b"), CharRenderer())
        assert service.engine.model_fingerprint == "model-a"
    finally:
        old.manual = False
        old.advance(1000)
        service.close()


async def test_f5_lists_the_models_and_switches_to_the_one_chosen():
    from kvchat.testing.fake_engine import fake_backend
    from kvchat.testing.tui import fake_app, ready, wait_until
    from kvchat.tui.backend import ModelChoice, TuiBackend
    from kvchat.tui.model_picker import ModelPicker

    choices = (
        ModelChoice("model-a", "folder", "gguf, 90MiB, Q4_1, llama", current=True),
        ModelChoice("gemma", "hf-cache", "hf, 2GiB, gemma3_text", reason="Unsupported"),
        ModelChoice("model-b", "ollama", "gguf, 90MiB, Q4_0, qwen3"),
    )
    switched: list[str] = []

    def switch(name: str, progress) -> TuiBackend:
        switched.append(name)
        chat = fake_backend(fingerprint=name)
        return TuiBackend(chat=chat, description=f"{name}: fake", close=chat.engine.close)

    app, engine = fake_app(fingerprint="model-a", models=lambda: choices, switch=switch)
    async with app.run_test(size=(150, 45), notifications=True) as pilot:
        await ready(pilot, app)
        app.chat.composer.text = "hello"
        await pilot.press("enter")
        await wait_until(pilot, lambda: app.chat.current is not None and len(engine.submitted) == 1)
        talked = app.chat.current
        await wait_until(pilot, lambda: app.service.wait_idle(talked, timeout=0), what="idle")
        await pilot.press("f5")
        await wait_until(pilot, lambda: isinstance(app.screen, ModelPicker), what="the picker")
        listing = app.screen.query_one("OptionList")
        assert listing.highlighted == 0  # the running model
        assert listing.get_option_at_index(1).disabled  # gemma: cannot run, with the reason
        await pilot.press("down", "enter")  # skips the disabled one
        await wait_until(pilot, lambda: switched == ["model-b"], what="the switch")
        await wait_until(
            pilot,
            lambda: app.service.engine.model_fingerprint == "model-b",
            what="the sessions on the new engine",
        )
        await wait_until(
            pilot,
            lambda: any("Now running model-b" in n.message for n in app._notifications),
            what="the notice",
        )
        assert not engine._running  # the old engine is closed once the new one serves
        assert app.service.session(talked).notice is not None  # its history: rendered again


def test_the_real_backend_lists_the_machines_models_and_loads_another(
    tmp_path, monkeypatch, tiny_llama_dir, tiny_qwen2_dir
):
    import shutil

    from kvchat.chat.settings import Settings
    from kvchat.cli import build_parser
    from kvchat.tui.backend import start_real_backend

    for name in ("HOME", "HF_HOME", "OLLAMA_MODELS"):  # no store of the user's is read
        monkeypatch.setenv(name, str(tmp_path / name.lower()))
    shutil.copytree(tiny_qwen2_dir, tmp_path / "models" / "qwen")
    settings = Settings(model_dirs=(str(tmp_path / "models"),))
    args = build_parser().parse_args(
        ["chat", "--model", str(tiny_llama_dir), "--dtype", "float32",
         "--device-cache", "16MiB", "--host-cache", "0", "--disk-cache", "0"]
    )  # fmt: skip
    first = start_real_backend(args, settings, lambda _line: None)
    second = None
    try:
        (qwen,) = [c for c in first.models() if c.name == "qwen"]
        assert (qwen.source, qwen.current, qwen.reason) == ("folder", False, None)
        assert "qwen2" in qwen.detail
        second = first.switch("qwen", lambda _line: None)
        assert second.chat.engine.model_fingerprint != first.chat.engine.model_fingerprint
        assert (first.model_name, second.model_name) == (str(tiny_llama_dir), "qwen")
        assert first.has_model("qwen") and first.has_model(str(tiny_llama_dir))
        assert not first.has_model("gone-model")
        assert [c.current for c in second.models() if c.name == "qwen"] == [True]
    finally:
        first.close()
        if second is not None:
            second.close()


def talked_with_model_a(path) -> tuple[SessionService, str]:
    """A service on `path` running "model-a", and a session with one turn on it."""
    renderer = CharRenderer()
    service = SessionService(
        FakeEngine(fingerprint="fp-a"), renderer, Store(path),
        stop_token_ids=renderer.stop_token_ids, model_name="model-a",
    )  # fmt: skip
    sid = service.create_session()
    service.say(sid, "hello")
    assert service.wait_idle(sid, timeout=10)
    return service, sid


def test_a_session_remembers_its_models_name_across_restarts(tmp_path):
    path = tmp_path / "sessions.db"
    renderer = CharRenderer()
    service, sid = talked_with_model_a(path)
    assert service.session(sid).model_name == "model-a"
    service.replace_backend(FakeEngine(fingerprint="fp-b"), renderer, model_name="model-b")
    assert service.session(sid).model_name == "model-a"  # until a turn runs on model-b
    service.close()
    reopened = SessionService(FakeEngine(fingerprint="fp-b"), renderer, Store(path))
    try:
        assert reopened.session(sid).model_name == "model-a"
    finally:
        reopened.close()


@pytest.mark.parametrize(
    ("here", "says"),
    [(True, "written with model-a; model-b runs now (f5 switches)"),
     (False, "written with model-a, which is no longer on this machine")],
)  # fmt: skip
async def test_opening_a_session_of_another_model_says_whose_it_is(tmp_path, here, says):
    from kvchat.testing.tui import fake_app, ready, wait_until

    path = tmp_path / "sessions.db"
    writer, sid = talked_with_model_a(path)
    writer.close()
    app, _ = fake_app(
        store=Store(path), fingerprint="fp-b", model_name="model-b", has_model=lambda _n: here
    )
    async with app.run_test(size=(150, 45), notifications=True) as pilot:
        await ready(pilot, app)
        if app.chat.current != sid:
            await app.chat.switch_to(sid)
        await wait_until(
            pilot,
            lambda: any(says in n.message for n in app._notifications),
            what="whose model the session was written with",
        )
