"""Bad input on the command line and in the settings file: one line naming its source, exit 2,
before any model loads; `kvchat` with no terminal; `kvchat run --help` documents scripts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvchat.chat.settings import load_settings, parse_settings
from kvchat.cli import build_parser, main
from kvchat.errors import UsageError
from kvchat.runtime import resolve_options
from kvchat.tui.main import require_terminal

REPO = Path(__file__).resolve().parents[1]


def options(*argv: str, settings_text: str | None = None):
    args = build_parser().parse_args(["chat", *argv])
    settings = parse_settings(settings_text, Path("/cfg/settings.toml")) if settings_text else None
    return resolve_options(args, settings or load_settings())


def fail_if_loaded(*_args, **_kwargs):
    raise AssertionError("the model must not load for bad input")


@pytest.fixture
def no_model(monkeypatch):
    """Any attempt to start an engine fails the test."""
    import kvchat.runtime

    monkeypatch.setattr(kvchat.runtime, "start_engine", fail_if_loaded)


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--device-cache", "0", "--device-cache 0: this cache cannot be off"),
        ("--device-cache", "512", "--device-cache: '512' has no unit"),
        ("--host-cache", "512", "--host-cache: '512' has no unit"),
        ("--device-cache", "lots", "--device-cache: 'lots' is not a size"),
        ("--page-size", "0", "--page-size must be a power of two from 16 up"),
        ("--page-size", "24", "--page-size must be a power of two from 16 up"),
        ("--max-tokens", "0", "--max-tokens must be a positive integer"),
        ("--context-size", "100", "--context-size must be an integer from 256 up"),
    ],
)
def test_a_bad_size_flag_is_refused_naming_the_flag(flag, value, message) -> None:
    with pytest.raises(UsageError, match=message):
        options(flag, value)


def test_zero_turns_the_host_cache_off_and_sizes_keep_their_units() -> None:
    opts = options("--host-cache", "0", "--device-cache", "64MiB", "--page-size", "16")
    assert opts.host_cache == 0 and opts.device_cache == 64 << 20 and opts.page_size == 16
    assert opts.sources["device_cache"] == "--device-cache"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("device_cache = 512\n", r"settings\.toml, line 1: 'device_cache' must be a size"),
        ('\n\ndevice_cache = "0"\n', r"line 3: 'device_cache' must be a size.*cannot be 0"),
        ('host_cache = "512"\n', r"line 1: 'host_cache' must be a size"),
        ("page_size = 0\n", r"line 1: 'page_size' must be a power of two"),
    ],
)
def test_a_bad_size_in_the_settings_file_names_the_file_and_line(text, message) -> None:
    with pytest.raises(UsageError, match=message):
        parse_settings(text, Path("/cfg/settings.toml"))


def test_settings_record_where_each_value_was_written() -> None:
    opts = options(settings_text='theme = "x"\nhost_cache = 0\ndevice_cache = "1GiB"\n')
    assert opts.host_cache == 0 and opts.device_cache == 1 << 30
    assert opts.sources["device_cache"] == "the settings file /cfg/settings.toml, line 3"


def test_the_cli_exits_2_for_a_bad_flag_before_loading(capsys, no_model) -> None:
    code = main(["ask", "hello", "--device-cache", "0"])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("kvchat: --device-cache 0")


def test_an_empty_question_exits_2_before_loading(capsys, no_model) -> None:
    assert main(["ask", "  "]) == 2
    assert "the question is empty" in capsys.readouterr().err


def test_run_help_lists_every_op_and_key(capsys) -> None:
    with pytest.raises(SystemExit):
        main(["run", "--help"])
    text = capsys.readouterr().out
    for word in ("new", "say", "wait", "stop", "switch", "stats"):
        assert f"\n  {word} " in text
    for key in ("session", "system", "text", "file", "max_tokens", "temperature", "ignore_eos"):
        assert key in text
    assert "a number at least 0" in text and '{"op": "say"' in text


class _Stream:
    def __init__(self, tty: bool) -> None:
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


@pytest.mark.parametrize("which", ["stdin", "stdout", "screen"])
def test_the_tui_refuses_to_start_without_a_terminal(which) -> None:
    streams = {name: _Stream(name != which) for name in ("stdin", "stdout", "screen")}
    with pytest.raises(UsageError, match="needs a terminal") as caught:
        require_terminal(**streams)
    assert "kvchat run" in str(caught.value) and "kvchat ask" in str(caught.value)
    require_terminal(*(_Stream(True) for _ in range(3)))


def test_kvchat_with_no_terminal_prints_one_line_and_exits_2(tmp_path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvchat"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=120,
    )
    assert done.returncode == 2
    assert done.stdout == ""
    assert done.stderr.count("\n") == 1 and "needs a terminal" in done.stderr
