"""Settings file, sizes, the error log and `kvchat paths`."""

from __future__ import annotations

import logging

import pytest

from kvchat.chat.error_log import configure_error_log, log_exception, paths_report
from kvchat.chat.settings import Settings, load_settings, save_setting
from kvchat.errors import KvchatError
from kvchat.paths import app_paths
from kvchat.units import parse_size


@pytest.fixture(autouse=True)
def _home(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path / "home"))


def write(text: str):
    path = app_paths().settings_file
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def test_missing_file_gives_defaults() -> None:
    assert load_settings() == Settings()


def test_a_full_file_is_read_with_types() -> None:
    write(
        'model = "/m/smol"\ndtype = "float32"\ndevice_cache = "512MiB"\nhost_cache = "4GiB"\n'
        "page_size = 128\nseed = 7\ntemperature = 0.5\ntop_p = 0.9\nmax_tokens = 64\n"
        'theme = "dark"\n[keys]\nnew_session = "ctrl+n"\n'
    )
    s = load_settings()
    assert s.device_cache == 512 * 2**20 and s.host_cache == 4 * 2**30
    assert (s.page_size, s.seed, s.temperature, s.max_tokens) == (128, 7, 0.5, 64)
    assert dict(s.keys) == {"new_session": "ctrl+n"}


def test_unknown_key_is_named_with_its_line() -> None:
    write('theme = "dark"\ntemprature = 0.3\n')
    with pytest.raises(KvchatError, match=r"line 2: unknown setting 'temprature'"):
        load_settings()


def test_wrong_type_is_named_with_its_line() -> None:
    write('seed = 1\n\nmax_tokens = "many"\n')
    with pytest.raises(KvchatError, match=r"line 3: 'max_tokens' must be a positive integer"):
        load_settings()
    write('host_cache = "lots"\n')
    with pytest.raises(KvchatError, match=r"'host_cache' must be a size"):
        load_settings()


def test_one_bad_key_keeps_the_good_ones_and_each_problem_is_one_sentence() -> None:
    from kvchat.chat.settings import load_settings_checked

    write('theme = "kvchat-light"\npage_size = 100\ntemprature = 0.3\nmax_tokens = 64\n')
    settings, problems = load_settings_checked()
    assert settings.theme == "kvchat-light" and settings.max_tokens == 64  # kept
    assert settings.page_size == Settings().page_size  # the bad one keeps its default
    assert len(problems) == 2
    assert "line 2: 'page_size'" in problems[0] and "line 3: unknown setting" in problems[1]
    assert all(p.endswith(".") and p.count(". ") <= 1 for p in problems)


def test_the_context_size_setting_is_checked_and_feeds_the_options() -> None:
    from kvchat.chat.settings import load_settings_checked

    write("context_size = 100\n")
    settings, problems = load_settings_checked()
    assert settings.context_size is None and "'context_size'" in problems[0]
    write("context_size = 4096\n")
    settings, problems = load_settings_checked()
    assert settings.context_size == 4096 and problems == ()


def test_the_commands_say_each_settings_problem_once(tmp_path) -> None:
    import os
    import subprocess
    import sys

    write('page_size = 100\ntheme = "kvchat-light"\n')
    done = subprocess.run(
        [sys.executable, "-m", "kvchat", "ask", "--engine", "http://127.0.0.1:9/v1", "hi"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ},
    )
    lines = [line for line in done.stderr.splitlines() if "page_size" in line]
    assert len(lines) == 1, done.stderr
    assert lines[0].endswith("Its default is used; the file is left as it is.")


def test_invalid_toml_names_the_line() -> None:
    write('theme = "dark"\nseed = = 3\n')
    with pytest.raises(KvchatError, match=r"not valid TOML: .*line 2"):
        load_settings()


def test_save_setting_keeps_comments_and_other_keys() -> None:
    path = write('# my settings\ntheme = "old"  \nseed = 3\n\n[keys]\nquit = "ctrl+q"\n')
    save_setting("theme", "nord")
    text = path.read_text()
    assert text.startswith('# my settings\ntheme = "nord"\nseed = 3\n')
    assert load_settings().theme == "nord" and dict(load_settings().keys) == {"quit": "ctrl+q"}
    save_setting("max_tokens", 99)
    assert load_settings().max_tokens == 99 and load_settings().keys["quit"] == "ctrl+q"


def test_save_setting_refuses_a_broken_file_and_bad_values() -> None:
    path = write("seed = = 3\n")
    with pytest.raises(KvchatError):
        save_setting("theme", "nord")
    assert path.read_text() == "seed = = 3\n"
    path.write_text("")
    with pytest.raises(KvchatError, match="unknown setting"):
        save_setting("colour", "red")
    with pytest.raises(KvchatError, match="page_size"):
        save_setting("page_size", "big")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("512MiB", 512 * 2**20),
        ("4GiB", 4 * 2**30),
        ("1.5G", int(1.5 * 2**30)),
        ("2GB", 2 * 10**9),
        ("1000B", 1000),
        ("0", 0),
        (0, 0),
    ],
)
def test_parse_size_reads_units(text, expected) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["", "4 parsecs", "-1MiB", "MiB", True, 1.5])
def test_parse_size_rejects_nonsense(text) -> None:
    with pytest.raises(KvchatError, match="not a size"):
        parse_size(text)


@pytest.mark.parametrize("text", ["1000", "512", 64, " 2 "])
def test_parse_size_refuses_a_number_without_a_unit(text) -> None:
    with pytest.raises(KvchatError, match="has no unit"):
        parse_size(text)


def test_error_log_keeps_the_traceback() -> None:
    path = configure_error_log()
    try:
        raise ValueError("deep bug")
    except ValueError:
        log_exception("while testing")
    for handler in logging.getLogger("kvchat").handlers:
        handler.flush()
    text = path.read_text()
    assert "while testing" in text and "Traceback" in text and "deep bug" in text
    logger = logging.getLogger("kvchat")
    for handler in list(logger.handlers):
        if handler.get_name() == "kvchat-error-log":
            logger.removeHandler(handler)
            handler.close()


def test_paths_report_lists_every_location() -> None:
    report = paths_report()
    paths = app_paths()
    for p in (
        paths.database,
        paths.settings_file,
        paths.themes_dir,
        paths.models_dir,
        paths.error_log,
    ):
        assert str(p) in report
