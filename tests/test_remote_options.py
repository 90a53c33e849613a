"""Choosing a remote engine on the command line and in settings; what is refused, and how."""

from __future__ import annotations

import argparse

import pytest

from kvchat.chat.settings import Settings, parse_settings
from kvchat.cli import main
from kvchat.engine.api import CacheCounters, CachedTokens
from kvchat.remote.engine import RemoteStats, _cached_tokens
from kvchat.remote.options import remote_options
from kvchat.remote.server import RemoteError, server_root


def test_server_root_strips_a_trailing_v1_and_refuses_what_is_not_a_url() -> None:
    assert server_root("http://127.0.0.1:8000/v1") == "http://127.0.0.1:8000"
    assert server_root("https://host/api/v1/") == "https://host/api"
    assert server_root("http://host:30000") == "http://host:30000"
    with pytest.raises(RemoteError, match="--engine takes 'embedded'"):
        server_root("localhost:8000")


def test_command_line_engine_overrides_the_settings_and_embedded_wins_over_a_url() -> None:
    settings = Settings(engine="http://a:1/v1", api_key_env="MY_KEY", session_header="X-Conv")
    none = argparse.Namespace(engine=None, remote_model=None, api_key_env=None, session_header=None)
    options = remote_options(none, settings)
    assert options is not None
    assert (options.url, options.api_key_env, options.session_header) == (
        "http://a:1/v1",
        "MY_KEY",
        "X-Conv",
    )
    assert (
        remote_options(argparse.Namespace(**{**vars(none), "engine": "embedded"}), settings) is None
    )
    defaults = remote_options(
        argparse.Namespace(**{**vars(none), "engine": "http://b:2"}), Settings()
    )
    assert defaults is not None
    assert (defaults.api_key_env, defaults.session_header) == ("OPENAI_API_KEY", "X-Session-ID")


def test_settings_file_takes_the_remote_keys(tmp_path) -> None:
    text = 'engine = "http://h:8000/v1"\nremote_model = "m"\napi_key_env = "K"\n'
    s = parse_settings(text, tmp_path / "settings.toml")
    assert (s.engine, s.remote_model, s.api_key_env) == ("http://h:8000/v1", "m", "K")


@pytest.mark.parametrize(
    "flag",
    [["--model", "x.gguf"], ["--kv", "int8"], ["--device-cache", "1GiB"], ["--page-size", "64"]],
)
@pytest.mark.parametrize("command", ["ask", "run", "chat"])
def test_embedded_only_flags_are_refused_with_a_server(capsys, command, flag) -> None:
    extra = {"ask": ["hello"], "run": ["script.jsonl"], "chat": []}[command]
    code = main([command, *extra, "--engine", "http://127.0.0.1:9/v1", *flag])
    assert code == 2
    err = capsys.readouterr().err
    assert err.startswith(f"kvchat: {flag[0]} is an option of the embedded engine")
    assert "\n" not in err.strip()


def test_a_bad_engine_url_is_bad_input(capsys) -> None:
    assert main(["ask", "hi", "--engine", "ftp://x"]) == 2
    assert "--engine takes 'embedded'" in capsys.readouterr().err


def test_unreachable_server_is_one_line_not_a_traceback(capsys) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # nothing listens there once closed
    assert main(["ask", "hi", "--engine", f"http://127.0.0.1:{port}/v1"]) == 1
    err = capsys.readouterr().err.strip()
    assert err == f"kvchat: cannot reach the server at http://127.0.0.1:{port}: is it running? " + (
        "Check --engine URL"
    )


def test_cached_tokens_are_null_unless_the_server_reports_them() -> None:
    class Details:
        cached_tokens = 256

    class Usage:
        prompt_tokens = 300
        prompt_tokens_details = Details()
        model_extra = None

    class Bare:
        prompt_tokens = 300
        prompt_tokens_details = None
        model_extra = None

    assert _cached_tokens(Usage(), None, reports=False) == 256
    assert _cached_tokens(Bare(), None, reports=True) == 0  # vLLM omits the object for 0
    assert _cached_tokens(Bare(), None, reports=False) is None  # never a made-up zero
    assert _cached_tokens(Bare(), {"cache_n": 40, "prompt_n": 9}, reports=False) == 40


def test_remote_stats_json_keeps_every_key_with_nulls_and_names_the_engine() -> None:
    engine = {"kind": "vllm", "url": "http://h:1", "model": "m"}
    counters = CacheCounters(prompt_tokens=10, cached_tokens=CachedTokens(4, 0, 0))
    stats = RemoteStats(cache=counters, engine=engine)
    out = stats.to_json()
    assert out["cached_tokens"] == {"device": None, "host": None, "disk": None}
    assert out["hit_rate"] is None and out["recomputed_tokens"] is None
    assert out["engine"] == engine
    reported = RemoteStats(cache=counters, engine=engine, reports_cached=True).to_json()
    assert reported["cached_tokens"] == {"device": 4, "host": None, "disk": None}
    assert reported["hit_rate"] == pytest.approx(0.4)


def test_bench_serving_peers_are_skipped_with_their_reason_without_a_path(tmp_path) -> None:
    from types import SimpleNamespace

    from kvchat.bench.runner import load_peers, parse_peers

    assert parse_peers("vllm,llama-server") == ["llama-server", "vllm"]
    model = SimpleNamespace(source=tmp_path / "m.gguf")
    chat, speed, skipped = load_peers(["llama-server", "vllm"], model, print, {})
    assert chat == {} and speed == {}
    assert "give --llama-server PATH" in skipped["llama-server"]
    assert "give --vllm-python PATH" in skipped["vllm"]
    missing = {"llama-server": str(tmp_path / "nothing")}
    _, _, skipped = load_peers(["llama-server"], model, print, missing)
    assert skipped["llama-server"] == f"no llama-server at {tmp_path / 'nothing'}"


def test_the_one_slot_llama_server_peer_runs_the_llama_server_binary_given(tmp_path) -> None:
    """`llama-server-1slot` takes `--llama-server`'s path and one slot, and W2 (which runs
    the peers that have `concurrent`) leaves it out."""
    from types import SimpleNamespace

    from kvchat.bench.peers.serving import OneSlotLlamaServerPeer
    from kvchat.bench.runner import load_peers

    model = SimpleNamespace(source=tmp_path / "m.gguf")
    binary = tmp_path / "llama-server"
    binary.write_text("")
    both = ["llama-server", "llama-server-1slot"]
    chat, _, skipped = load_peers(both, model, print, {"llama-server": str(binary)})
    assert skipped == {} and set(chat) == set(both)
    one = chat["llama-server-1slot"]
    assert isinstance(one, OneSlotLlamaServerPeer) and one.binary == binary and one.slots == 1
    assert "-np 1" in one.description and not hasattr(one, "concurrent")
    assert hasattr(chat["llama-server"], "concurrent")
    _, _, skipped = load_peers(["llama-server-1slot"], model, print, {})
    assert "give --llama-server PATH" in skipped["llama-server-1slot"]
