"""W2 on the serving peers: eight conversations streamed at once from real servers.

Each server is a real one on 127.0.0.1 (tests/servers.py; skipped with the reason
where it cannot be built or started). The checks are the promises W2's figures
rest on: every stream generated exactly the tokens asked for (the server's own
token counter agrees), llama-server ran with a slot per conversation, and the
command line puts the servers' rows into W2's table. Timings are only checked
to be positive: this machine is shared.
"""

from __future__ import annotations

import json
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvchat.bench import documents as docs
from kvchat.bench.peers.serving import LlamaServerPeer, OneSlotLlamaServerPeer, ServerChat
from kvchat.cli import main
from tests.servers import Server

pytestmark = pytest.mark.slow

TOKENS = 8
GENERATED = {  # each server's counter of the tokens it generated
    "llama-server": "llamacpp:tokens_predicted_total",
    "vllm": "vllm:generation_tokens_total",
}


@pytest.fixture(params=["llama_server", "vllm_server"])
def server(request) -> Server:
    return request.getfixturevalue(request.param)


def _generated_total(server: Server) -> float:
    """The server's own count of the tokens it has generated since it started."""
    with urllib.request.urlopen(server.root + "/metrics", timeout=10) as response:
        text = response.read().decode()
    name = GENERATED[server.kind]
    return sum(
        s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name
    )


def _get(port: int, path: str):
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as response:
        return json.load(response)


def test_w2_streams_eight_conversations_each_to_the_exact_token(server: Server) -> None:
    questions = list(docs.W2_QUESTIONS)
    assert len(questions) == 8
    chat = ServerChat(server.port, server.model)
    before = _generated_total(server)
    try:
        result = chat.concurrent(questions, TOKENS)
    finally:
        chat.close()
    assert _generated_total(server) - before == len(questions) * TOKENS
    assert (result.sequences, result.tokens_each) == (8, TOKENS)
    assert result.decode_tok_s > 0 and result.wall_s > 0
    assert result.wall_tok_s == pytest.approx(8 * TOKENS / result.wall_s)


def test_llama_server_peer_runs_w2_with_a_slot_per_conversation(
    llama_server: Server, default_gguf_path: Path
) -> None:
    peer = LlamaServerPeer(Path(llama_server.argv[0]), default_gguf_path, print)
    try:
        result = peer.concurrent(list(docs.W2_QUESTIONS), TOKENS, 4096)
        assert peer.server is not None
        assert _get(peer.server.port, "/props")["total_slots"] == 8
        # every slot took a request: none of the eight waited for another to finish
        assert all(slot["id_task"] >= 0 for slot in _get(peer.server.port, "/slots"))
    finally:
        peer.close()
    assert result.sequences == 8 and result.decode_tok_s > 0 and result.wall_s > 0
    assert "-np 8" in peer.description


def test_bench_runs_w2_for_llama_server_beside_kvchat(
    llama_server: Server, default_gguf_path: Path, tmp_path: Path
) -> None:
    out = tmp_path / "out"
    argv = ["bench", "--quick", "--model", str(default_gguf_path), "--workloads", "W2"]
    argv += ["--peers", "llama-server", "--llama-server", llama_server.argv[0]]
    assert main([*argv, "--out", str(out)]) == 0
    results = json.loads((out / "bench.json").read_text())
    w2 = results["workloads"]["W2"]
    assert not w2["errors"], w2["errors"]
    assert {"kvchat", "llama-server"} <= set(w2["engines"])
    median = w2["engines"]["llama-server"]["median"]
    assert median["decode_tok_s"] > 0 and median["wall_s"] > 0 and median["wall_tok_s"] > 0
    assert "-np 8" in results["engines"]["llama-server"]
    # the server's own peak memory, read before it was stopped: above the model it maps
    peak = w2["engines"]["llama-server"]["peak_rss"]
    assert peak["process"] == "llama-server" and not peak["shared"]
    assert peak["bytes"] > default_gguf_path.stat().st_size / 2
    table = (out / "bench.md").read_text().split("## W2", 1)[1].split("\n## ", 1)[0]
    assert "| llama-server |" in table


def test_the_one_slot_llama_server_peer_serves_every_session_from_one_slot(
    llama_server: Server, default_gguf_path: Path
) -> None:
    """`llama-server-1slot`: the server runs one slot, and a switch between two sessions
    is served by it (the second session's turn and the first's follow-up both answer)."""
    peer = OneSlotLlamaServerPeer(Path(llama_server.argv[0]), default_gguf_path, print)
    try:
        chat = peer.chat(4096)
        assert peer.server is not None
        assert _get(peer.server.port, "/props")["total_slots"] == 1
        first, second = chat.new_session(), chat.new_session()
        for session in (first, second, first):
            result = chat.turn(session, "Name a color.", TOKENS)
            assert result.ttft_s > 0
    finally:
        peer.close()
    assert "-np 1" in peer.description and peer.name == "llama-server-1slot"
    assert not hasattr(peer, "concurrent")  # W2 leaves it out
    assert peer.peak_rss() is not None and peer.peak_rss().process == "llama-server-1slot"
