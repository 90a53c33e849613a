"""The servers cache: one folder outside the checkout, found alike by Python and the scripts.

kvchat/testing/servers_dir.py names it for the tests and the benchmarks; the build
and install scripts and `.ci/run` compute it in bash, since they run without
kvchat installed. The folder is a build cache shared on purpose, so it must not be
one of the user's own kvchat folders, which the tests must never change.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from kvchat.paths import app_paths
from kvchat.testing.servers_dir import servers_dir

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = (
    ROOT / "benchmarks" / "servers" / "build_llama_server.sh",
    ROOT / "benchmarks" / "servers" / "install_vllm.sh",
    ROOT / ".ci" / "run",
)
VARIABLES = ("KVCHAT_SERVERS_DIR", "XDG_CACHE_HOME")


def _bash_servers_dir(script: Path, env: dict[str, str]) -> Path:
    """The folder the script's own `SERVERS=` line gives, run in bash under `env`."""
    lines = [line for line in script.read_text().splitlines() if line.startswith('SERVERS="')]
    assert len(lines) == 1, f"{script.name} names the servers cache in one line"
    code = f'set -eu; {lines[0]}; printf %s "$SERVERS"'
    done = subprocess.run(["bash", "-c", code], env=env, capture_output=True, text=True, check=True)
    return Path(done.stdout)


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
@pytest.mark.parametrize(
    "settings",
    [{}, {"XDG_CACHE_HOME": "/xdg/cache"}, {"XDG_CACHE_HOME": ""}, {"KVCHAT_SERVERS_DIR": "/s"}],
    ids=["default", "xdg", "empty-xdg", "override"],
)
def test_the_scripts_find_the_servers_cache_where_servers_dir_does(
    script: Path, settings: dict[str, str], tmp_path: Path, monkeypatch
) -> None:
    home = str(tmp_path / "home")
    env = {k: v for k, v in os.environ.items() if k not in VARIABLES} | {"HOME": home}
    env |= settings
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", home)
    for name, value in settings.items():
        monkeypatch.setenv(name, value)
    assert _bash_servers_dir(script, env) == servers_dir()


def test_the_servers_cache_is_outside_the_checkout_and_the_users_kvchat_folders(
    monkeypatch,
) -> None:
    monkeypatch.delenv("KVCHAT_SERVERS_DIR", raising=False)
    monkeypatch.delenv("KVCHAT_HOME", raising=False)  # app_paths() is then the user's own
    folder = servers_dir().resolve()
    assert not folder.is_relative_to(ROOT)
    paths = app_paths()
    for own in (paths.data_dir, paths.config_dir, paths.cache_dir, paths.log_dir):
        assert not folder.is_relative_to(own.resolve()), (folder, own)
