"""kvchat's sessions on real serving engines (llama-server, vLLM) on 127.0.0.1.

The servers are built/installed once into the servers cache outside the checkout
(kvchat/testing/servers_dir.py) and started once per run (tests/servers.py); every
test here talks to a real server, faults included (through tests/fault_proxy.py in
front of one). Replies are short: the checks are about figures, streaming and
failures, not text quality.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request

import pytest

from kvchat.chat.events import ReplyDelta, ReplyFinished, SessionFailed
from kvchat.chat.service import SessionService
from kvchat.chat.session import MessageState
from kvchat.chat.store import Store
from kvchat.cli import main
from kvchat.engine.request import SamplingParams
from kvchat.remote import RemoteError, RemoteOptions, open_remote_backend
from kvchat.remote.metrics import parse_metrics
from tests.fault_proxy import FaultProxy
from tests.servers import Server, start_llama_server

pytestmark = pytest.mark.slow

# ~300 tokens, so the follow-up's prompt holds whole cache blocks of any server
DOCUMENT = " ".join(
    f"Fact {i}: the station at kilometre {i * 7} has {i % 5 + 2} platforms." for i in range(30)
)


@pytest.fixture(params=["llama_server", "vllm_server"])
def server(request) -> Server:
    return request.getfixturevalue(request.param)


def _service(url: str, **kw) -> tuple[SessionService, list]:
    backend = open_remote_backend(RemoteOptions(url=url, **kw))
    service = SessionService(
        backend.engine,
        backend.renderer,
        Store.in_memory(),
        default_sampling=SamplingParams(temperature=0.0),
        default_max_tokens=8,
    )
    events: list = []
    service.subscribe(events.append)
    return service, events


def _finished(events: list, session_id: str) -> list[ReplyFinished]:
    return [e for e in events if isinstance(e, ReplyFinished) and e.session_id == session_id]


def _metrics(server: Server):
    with urllib.request.urlopen(server.root + "/metrics", timeout=10) as response:
        return parse_metrics(response.read().decode(), server.kind)


def test_a_turn_then_a_follow_up_the_server_reports_as_cached(server: Server) -> None:
    service, events = _service(server.url)
    try:
        assert service.engine.reports_cached
        before = _metrics(server)
        sid = service.create_session("doc")
        service.say(sid, f"{DOCUMENT}\n\nHow many platforms at kilometre 14?")
        assert service.wait_idle(sid, timeout=300)
        service.say(sid, "And at kilometre 21?")
        assert service.wait_idle(sid, timeout=300)
        first, second = (e.stats for e in _finished(events, sid))
        assert first.finish_reason in ("stop", "length") and first.generated_tokens > 0
        assert first.prompt_tokens > 250 and first.ttft_s is not None
        assert second.cached_tokens.device is not None and second.cached_tokens.device >= 128
        assert second.cached_tokens.host is None and second.cached_tokens.disk is None
        assert second.prefilled_tokens == second.prompt_tokens - second.cached_tokens.device
        assert second.recomputed_tokens is None
        assert second.hit_rate is not None and second.hit_rate > 0.5
        messages = service.messages(sid)
        assert [m.role for m in messages] == ["user", "assistant", "user", "assistant"]
        assert messages[-1].content and messages[-1].state == MessageState.COMPLETE
        assert any(isinstance(e, ReplyDelta) and e.token_ids == () for e in events)
        # the meters read the server's own counters: what kvchat's turns added to them
        poller = service.engine.poller
        assert poller is not None
        latest = poller.poll_once()
        after = _metrics(server)
        assert latest is not None and latest.prefix_hits == after.prefix_hits
        hits = (after.prefix_hits or 0) - (before.prefix_hits or 0)
        assert hits >= second.cached_tokens.device
        note = service.engine.cache_note()
        assert f"server prefix hits {after.hit_rate:.0%}" in note
    finally:
        service.close()


def test_sessions_stream_concurrently_and_stop_ends_one_keeping_its_text(server: Server) -> None:
    service, events = _service(server.url)
    try:
        ids = [service.create_session(f"s{i}") for i in range(3)]
        first_delta = threading.Event()
        service.subscribe(
            lambda e: (
                first_delta.set() if isinstance(e, ReplyDelta) and e.session_id == ids[0] else None
            )
        )
        service.say(ids[0], "Count from one to five hundred.", max_tokens=2000, ignore_eos=True)
        for sid in ids[1:]:
            service.say(sid, "Say hello.")
        assert first_delta.wait(120)
        service.stop(ids[0])
        assert service.wait_idle(timeout=300)
        stopped = _finished(events, ids[0])[0]
        assert stopped.stats.finish_reason == "cancelled"
        assert stopped.text and service.messages(ids[0])[-1].content == stopped.text
        for sid in ids[1:]:
            done = _finished(events, sid)
            assert done and done[0].stats.finish_reason in ("stop", "length")
        # the server aborted the request when its stream closed (its gauge updates a
        # moment later: waited for, up to 10 s, never slept on)
        deadline = time.monotonic() + 10
        while (_metrics(server).running or 0) != 0 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert (_metrics(server).running or 0) == 0
    finally:
        service.close()


def test_every_turn_carries_the_session_header(llama_server: Server) -> None:
    proxy = FaultProxy(llama_server.port)
    service, _ = _service(proxy.url, session_header="X-Conversation")
    try:
        a, b = service.create_session("a"), service.create_session("b")
        for sid in (a, b, a):
            service.say(sid, "Hi.")
            assert service.wait_idle(sid, timeout=120)
        sent = [h.get("x-conversation") for h in proxy.chat_headers[-3:]]
        assert sent == [a, b, a]
    finally:
        service.close()
        proxy.close()


def test_run_and_ask_on_a_server(llama_server: Server, tmp_path, capsys) -> None:
    script = tmp_path / "s.jsonl"
    lines = [
        {"op": "new", "session": "a"},
        {"op": "say", "session": "a", "text": DOCUMENT + " Which fact is first?"},
        {"op": "wait"},
        {"op": "say", "session": "a", "text": "And the last?"},
        {"op": "wait"},
        {"op": "stats"},
    ]
    script.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    code = main(["run", str(script), "--stream", "--max-tokens", "8", "--engine", llama_server.url])
    out = [json.loads(x) for x in capsys.readouterr().out.splitlines()]
    assert code == 0
    replies = [e for e in out if e["event"] == "reply"]
    assert len(replies) == 2
    follow = replies[1]
    assert follow["cached_tokens"]["host"] is None and follow["cached_tokens"]["disk"] is None
    assert follow["cached_tokens"]["device"] > 0
    assert follow["recomputed_tokens"] is None
    assert follow["prefilled_tokens"] == follow["prompt_tokens"] - follow["cached_tokens"]["device"]
    tokens = [e for e in out if e["event"] == "token"]
    assert tokens and all(t["ids"] is None for t in tokens)
    stats = next(e for e in out if e["event"] == "stats")
    assert stats["engine"] == {"kind": "llama-server", "url": llama_server.root, "model": "smollm2"}
    assert stats["pages"] is None and stats["recomputed_tokens"] is None

    code = main(["ask", "Say yes.", "--max-tokens", "4", "--engine", llama_server.url])
    captured = capsys.readouterr()
    assert code == 0 and captured.out.strip()
    assert "llama-server at" in captured.err and "model smollm2" in captured.err


# -------------------------------------------------------------------- faults


def test_api_key_is_asked_for_refused_when_wrong_and_never_shown(
    default_gguf_path, monkeypatch
) -> None:
    guarded = start_llama_server(default_gguf_path, api_key="s3cret-key", slots=1, ctx=2048)
    try:
        monkeypatch.delenv("KVCHAT_TEST_KEY", raising=False)
        options = RemoteOptions(url=guarded.url, api_key_env="KVCHAT_TEST_KEY")
        with pytest.raises(RemoteError, match=r"wants an API key \(401\).*KVCHAT_TEST_KEY"):
            open_remote_backend(options)
        monkeypatch.setenv("KVCHAT_TEST_KEY", "wrong-key")
        with pytest.raises(RemoteError, match="refused the API key in KVCHAT_TEST_KEY") as bad:
            open_remote_backend(options)
        assert "wrong-key" not in str(bad.value)
        monkeypatch.setenv("KVCHAT_TEST_KEY", "s3cret-key")
        backend = open_remote_backend(options)
        backend.engine.close()
    finally:
        guarded.stop()


def test_a_wrong_model_name_names_the_served_ones(llama_server: Server) -> None:
    with pytest.raises(RemoteError, match="has no model 'nope'; it serves smollm2"):
        open_remote_backend(RemoteOptions(url=llama_server.url, model="nope"))


def test_vllm_404_for_an_unknown_model_is_one_line(vllm_server: Server) -> None:
    service, events = _service(vllm_server.url)
    try:
        engine = service.engine
        engine.info = type(engine.info)(**{**engine.info.__dict__, "model": "nope"})
        sid = service.create_session()
        service.say(sid, "Hi.")
        assert service.wait_idle(sid, timeout=120)
        stats = _finished(events, sid)[0].stats
        assert stats.finish_reason == "error" and "no model 'nope' (404)" in (stats.error or "")
    finally:
        service.close()


def test_overflow_is_caught_before_sending_and_the_servers_400_is_the_fallback(
    server: Server,
) -> None:
    service, events = _service(server.url)
    try:
        context = service.engine.context_length
        sid = service.create_session()
        huge = "word " * (context + 100)
        service.say(sid, huge)  # sized on the service's planner: refused, nothing sent
        assert service.wait_idle(sid, timeout=300)
        (refused,) = [e for e in events if isinstance(e, SessionFailed)]
        assert "does not fit in the model's context" in refused.message
        # the server's own 400, as when kvchat did not know its context length
        engine = service.engine
        engine.info = type(engine.info)(**{**engine.info.__dict__, "context_length": None})
        service.say(sid, huge)
        assert service.wait_idle(sid, timeout=300)
        stats = _finished(events, sid)[0].stats
        assert stats.finish_reason == "error"
        assert "does not fit in the server's context (400)" in (stats.error or "")
    finally:
        service.close()


def test_429_and_5xx_before_the_first_token_are_retried(llama_server: Server) -> None:
    proxy = FaultProxy(llama_server.port)
    service, events = _service(proxy.url)
    try:
        sid = service.create_session()
        proxy.fail_next = [429, 503]
        service.say(sid, "Hi.")
        assert service.wait_idle(sid, timeout=120)
        assert _finished(events, sid)[0].stats.finish_reason in ("stop", "length")
        proxy.fail_next = [503] * 30
        service.say(sid, "Again.")
        assert service.wait_idle(sid, timeout=300)
        failed = _finished(events, sid)[1].stats
        assert failed.finish_reason == "error"
        assert "failed (HTTP 503)" in (failed.error or "")
    finally:
        service.close()
        proxy.close()


@pytest.mark.parametrize("fault", ["cut", "stall"])
def test_a_stream_that_breaks_after_tokens_keeps_the_partial_reply(
    llama_server: Server, fault: str
) -> None:
    proxy = FaultProxy(llama_server.port)
    service, events = _service(proxy.url, stall_timeout_s=20.0)
    try:
        sid = service.create_session()
        if fault == "cut":
            proxy.cut_after = 4
        else:
            proxy.stall_after = 4
        service.say(sid, "Count to fifty.", max_tokens=60, ignore_eos=True)
        assert service.wait_idle(sid, timeout=120)
        reply = _finished(events, sid)[0]
        assert reply.stats.finish_reason == "error" and reply.text
        expected = "closed the stream mid-reply" if fault == "cut" else "stopped answering"
        assert expected in (reply.stats.error or "")
        assert "partial reply is kept" in (reply.stats.error or "")
        kept = service.messages(sid)[-1]  # stored as interrupted: nothing received is lost
        assert kept.content == reply.text and kept.state == MessageState.INTERRUPTED
        assert "_(interrupted)_" in service.export_markdown(sid)
        service.regenerate(sid)  # the user can go on
        assert service.wait_idle(sid, timeout=120)
        assert _finished(events, sid)[1].stats.finish_reason in ("stop", "length")
        assert service.messages(sid)[-1].state == MessageState.COMPLETE
    finally:
        service.close()
        proxy.close()


def test_server_killed_mid_stream_and_down_at_the_next_turn(default_gguf_path) -> None:
    doomed = start_llama_server(default_gguf_path, slots=1, ctx=4096)
    service, events = _service(doomed.url)
    try:
        sid = service.create_session()
        got = threading.Event()
        service.subscribe(lambda e: got.set() if isinstance(e, ReplyDelta) else None)
        service.say(sid, "Count to one thousand.", max_tokens=3000, ignore_eos=True)
        assert got.wait(120)
        doomed.kill()
        assert service.wait_idle(sid, timeout=120)
        reply = _finished(events, sid)[0]
        assert reply.stats.finish_reason == "error" and reply.text
        kept = service.messages(sid)[-1]
        assert kept.content == reply.text and kept.state == MessageState.INTERRUPTED
        service.say(sid, "Are you there?")
        assert service.wait_idle(sid, timeout=120)
        down = _finished(events, sid)[1].stats
        assert down.finish_reason == "error"
        assert "cannot reach the server" in (down.error or "")
        assert [m.content for m in service.messages(sid) if m.role == "user"][-1] == (
            "Are you there?"
        )
    finally:
        service.close()
        doomed.stop()


def test_bench_peers_on_servers_report_a_cached_follow_up(
    llama_server: Server, vllm_server: Server, default_gguf_path
) -> None:
    from pathlib import Path

    from kvchat.bench.peers.kvchat_remote import KvchatRemotePeer
    from kvchat.bench.peers.serving import LlamaServerPeer, ServerChat

    peer = LlamaServerPeer(Path(llama_server.argv[0]), default_gguf_path, print)
    on_vllm = KvchatRemotePeer(RemoteOptions(url=vllm_server.url), print)
    assert on_vllm.name == "kvchat@vllm"
    try:
        # vLLM's peer starts a server of its own; its chat is this same client, checked
        # here against the running one
        chats = (peer.chat(4096), ServerChat(vllm_server.port, vllm_server.model))
        for chat in (*chats, on_vllm.chat(4096)):
            session = chat.new_session()
            first = chat.turn(session, DOCUMENT, 4)
            second = chat.turn(session, "And the last fact?", 4)
            chat.close()
            assert first.generated_tokens == 4 and first.prompt_tokens > 250
            assert second.new_tokens < 40 and second.prefilled_tokens < second.prompt_tokens / 2
            assert 0 < second.ttft_s <= second.total_s
    finally:
        peer.close()


def test_bench_runs_w1_and_w2_through_a_server(llama_server: Server, tmp_path, monkeypatch) -> None:
    from tests.tiny_models import write_tiny_model

    # a tiny embedded model keeps the embedded engine's side of the run short
    folder = write_tiny_model(tmp_path / "tiny", "llama")
    out = tmp_path / "out"
    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path / "home"))
    argv = ["bench", "--quick", "--model", str(folder), "--dtype", "float32"]
    argv += ["--engine", llama_server.url, "--workloads", "W1,W2", "--peers", "none"]
    assert main([*argv, "--out", str(out)]) == 0
    results = json.loads((out / "bench.json").read_text())
    w2 = results["workloads"]["W2"]
    assert not w2["errors"], w2["errors"]
    on_server = w2["engines"]["kvchat@llama-server"]["median"]
    assert on_server["decode_tok_s"] > 0 and on_server["wall_s"] > 0
    assert w2["engines"]["kvchat"]["median"]["decode_tok_s"] > 0
    turns = results["workloads"]["W1"]["engines"]["kvchat@llama-server"]["runs"][0]["turns"]
    assert all(t["generated_tokens"] == results["plan"]["answer_tokens"] for t in turns)
