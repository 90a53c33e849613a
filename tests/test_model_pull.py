"""`kvchat pull` against a hub on 127.0.0.1 (tests/hub_server.py): the real
`huggingface_hub` client downloads into a temporary HF_HOME, `kvchat models` then
lists what came, an unsupported model is refused before its weights are fetched, and a
download cut off midway is resumed by the same command."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.hub_server import Hub, HubServer, Repo
from tests.tiny_gguf import write_tiny_gguf


@pytest.fixture
def hub(tmp_path, tiny_llama_dir):
    (tmp_path / "files").mkdir()
    q4 = write_tiny_gguf(tmp_path / "files" / "tiny-Q4_1.gguf", "Q4_1")
    q4_0 = write_tiny_gguf(tmp_path / "files" / "tiny-Q4_0.gguf", "Q4_0", seed=1)
    folder = {p.name: p for p in tiny_llama_dir.iterdir() if p.is_file()}
    hybrid = tmp_path / "files" / "falcon-h1-config.json"
    hybrid.write_text(
        (tiny_llama_dir / "config.json").read_text().replace('"llama"', '"falcon_h1"')
    )
    hub = Hub(
        {
            "tiny-org/tiny-llama": Repo({**folder, "README.md": folder["config.json"]}),
            "tiny-org/tiny-GGUF": Repo(
                {"tiny-Q4_1.gguf": q4, "tiny-Q4_K_M.gguf": q4_0, "README.md": q4},
                gguf_architecture="llama",
            ),
            "tiny-org/one-GGUF": Repo({"one-Q4_1.gguf": q4}, gguf_architecture="llama"),
            "tiny-org/falcon-h1": Repo({**folder, "config.json": hybrid}),
            "tiny-org/jamba-GGUF": Repo({"g-Q4_0.gguf": q4_0}, gguf_architecture="jamba"),
        }
    )
    server = HubServer(hub)
    yield server
    server.close()


def kvchat(*args: str, home: Path, endpoint: str) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "KVCHAT_HOME": str(home / "kvchat"),
        "HF_HOME": str(home / "hf"),
        "HF_ENDPOINT": endpoint,
        "HF_HUB_DISABLE_TELEMETRY": "1",
        "HF_HUB_DISABLE_XET": "1",
        "HOME": str(home),
        "OLLAMA_MODELS": str(home / "ollama"),
    }
    env.pop("HF_HUB_CACHE", None)
    env.pop("HF_TOKEN", None)
    return subprocess.run(
        [sys.executable, "-m", "kvchat", *args],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip


def answers(*, home: Path, endpoint: str, model: str) -> None:
    """`kvchat ask` runs the model by the name pull gave it."""
    asked = kvchat(
        "ask", "hi", "--model", model, "--dtype", "float32", "--max-tokens", "2",
        "--device-cache", "16MiB", "--host-cache", "0", "--disk-cache", "0",
        home=home, endpoint=endpoint,
    )  # fmt: skip
    assert asked.returncode == 0, asked.stderr


def test_a_gguf_repository_gives_the_file_asked_for_and_models_lists_it(hub, tmp_path):
    done = kvchat("pull", "tiny-org/tiny-GGUF:q4_1", home=tmp_path, endpoint=hub.url)
    assert done.returncode == 0, done.stderr
    path = Path(done.stdout.splitlines()[0])
    assert path.name == "tiny-Q4_1.gguf" and path.is_relative_to(tmp_path / "hf")
    assert "kvchat --model tiny-org/tiny-GGUF:Q4_1" in done.stdout
    assert hub.hub.downloads == ["tiny-org/tiny-GGUF/tiny-Q4_1.gguf"]  # that file only
    listed = kvchat("models", home=tmp_path, endpoint=hub.url).stdout
    assert any(line.startswith("tiny-org/tiny-GGUF ") for line in listed.splitlines())
    answers(home=tmp_path, endpoint=hub.url, model="tiny-org/tiny-GGUF")


def test_without_a_quant_q4_k_m_is_chosen_and_a_lone_file_needs_none(hub, tmp_path):
    done = kvchat("pull", "tiny-org/tiny-GGUF", home=tmp_path, endpoint=hub.url)
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.splitlines()[0]).name == "tiny-Q4_K_M.gguf"
    done = kvchat("pull", "tiny-org/one-GGUF", home=tmp_path, endpoint=hub.url)
    assert done.returncode == 0 and "kvchat --model tiny-org/one-GGUF\n" in done.stdout
    done = kvchat("pull", "tiny-org/tiny-GGUF:Q8_0", home=tmp_path, endpoint=hub.url)
    assert done.returncode == 1
    assert done.stderr.strip() == (
        "kvchat: tiny-org/tiny-GGUF has no Q8_0 file; pick one: Q4_1, Q4_K_M "
        "(as tiny-org/tiny-GGUF:QUANT)."
    )


def test_a_model_folder_comes_whole_and_runs(hub, tmp_path):
    done = kvchat("pull", "tiny-org/tiny-llama", home=tmp_path, endpoint=hub.url)
    assert done.returncode == 0, done.stderr
    folder = Path(done.stdout.splitlines()[0])
    assert (folder / "config.json").is_file() and (folder / "model.safetensors").is_file()
    assert not (folder / "README.md").exists()  # what a model folder needs, no more
    answers(home=tmp_path, endpoint=hub.url, model="tiny-org/tiny-llama")


@pytest.mark.parametrize(
    ("name", "says"),
    [
        (
            "tiny-org/falcon-h1",
            "tiny-org/falcon-h1 is not a model kvchat runs: Unsupported architecture",
        ),
        (
            "tiny-org/jamba-GGUF",
            "tiny-org/jamba-GGUF is a jamba model, which kvchat does not",
        ),
        ("tiny-org/nothing", "there is no model tiny-org/nothing on the hub"),
        ("not a name", "'not a name' is not a hub model name: use ORG/NAME"),
    ],
)
def test_what_cannot_be_pulled_is_said_in_one_line_before_any_weights(hub, tmp_path, name, says):
    done = kvchat("pull", name, home=tmp_path, endpoint=hub.url)
    assert done.returncode == 1
    assert done.stderr.startswith(f"kvchat: {says}"), done.stderr
    assert "Traceback" not in done.stderr and len(done.stderr.strip().splitlines()) == 1
    assert not [d for d in hub.hub.downloads if not d.endswith("config.json")]


def test_a_connection_lost_midway_is_resumed_from_where_it_stopped(hub, tmp_path):
    """huggingface_hub writes what it receives in chunks of 10 MiB and, when the
    connection drops, asks for the rest: a file past one chunk, cut after 15 MiB."""
    big = tmp_path / "files" / "big-Q4_0.gguf"
    big.write_bytes(os.urandom(24 << 20))
    hub.hub.repos["tiny-org/big-GGUF"] = Repo({big.name: big}, gguf_architecture="llama")
    hub.hub.fail_after = 15 << 20
    done = kvchat("pull", "tiny-org/big-GGUF", home=tmp_path, endpoint=hub.url)
    assert done.returncode == 0, done.stderr
    (asked,) = hub.hub.ranges  # the rest, once, not the file again
    assert int(asked.removeprefix("bytes=").split("-")[0]) >= 10 << 20
    assert Path(done.stdout.splitlines()[0]).read_bytes() == big.read_bytes()


def test_a_network_gone_midway_is_one_line_and_the_same_command_fetches_it_later(hub, tmp_path):
    """huggingface_hub keeps no partial file between runs (each download writes its own
    temporary file, removed on failure): the cache is left clean, nothing half-written
    passes for the model, and the command run again fetches it whole."""
    hub.hub.fail_after, hub.hub.stay_down = 40_000, True
    done = kvchat("pull", "tiny-org/one-GGUF", home=tmp_path, endpoint=hub.url)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert (
        done.stderr.strip().splitlines()[-1].startswith("kvchat: fetching tiny-org/one-GGUF failed")
    )
    assert "run the same command again" in done.stderr
    assert not list((tmp_path / "hf").rglob("*.gguf")) and not list(
        (tmp_path / "hf").rglob("*.incomplete")
    )
    hub.hub.failing = False
    done = kvchat("pull", "tiny-org/one-GGUF", home=tmp_path, endpoint=hub.url)
    assert done.returncode == 0, done.stderr
    assert Path(done.stdout.splitlines()[0]).read_bytes() == (
        hub.hub.repos["tiny-org/one-GGUF"].files["one-Q4_1.gguf"].read_bytes()
    )
