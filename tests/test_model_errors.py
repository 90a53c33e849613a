"""Every model problem a user can cause gives a clear message, never a traceback."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from kvchat.errors import ModelLoadError
from kvchat.model.loader import load_model


def run_cli(*args: str, env_home) -> subprocess.CompletedProcess:
    import os

    env = {**os.environ, "KVCHAT_HOME": str(env_home)}
    return subprocess.run(
        [sys.executable, "-m", "kvchat", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(ModelLoadError, match="No model found"):
        load_model(str(tmp_path / "nowhere"), device="cpu")


def test_corrupt_safetensors_header_is_a_clear_error(tmp_path, tiny_llama_dir):
    folder = tmp_path / "broken"
    shutil.copytree(tiny_llama_dir, folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(b"\xff" * 8 + b"{not json" + weights.read_bytes()[64:])
    with pytest.raises(ModelLoadError, match="corrupt or truncated"):
        load_model(str(folder), device="cpu")


def test_truncated_gguf_is_a_clear_error(tmp_path):
    from tests.tiny_gguf import write_tiny_gguf

    path = write_tiny_gguf(tmp_path / "t.gguf")
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    with pytest.raises(ModelLoadError, match="truncated"):
        load_model(str(path), device="cpu")


def test_unsupported_architecture_is_a_clear_error(tmp_path, tiny_llama_dir):
    folder = tmp_path / "gpt2ish"
    shutil.copytree(tiny_llama_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="Unsupported architecture 'GPT2LMHeadModel'"):
        load_model(str(folder), device="cpu")


def test_a_smollm3_layer_list_of_the_wrong_length_is_a_clear_error(tmp_path, tiny_llama_dir):
    """SmolLM3's no_rope_layers says which layers rotate: one entry short is a damaged
    folder, not a model to run with a guess."""
    folder = tmp_path / "smollm3"
    shutil.copytree(tiny_llama_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    layers = config["num_hidden_layers"]
    config.update(model_type="smollm3", no_rope_layers=[1] * (layers - 1))
    (folder / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match=rf"no_rope_layers has {layers - 1} entries"):
        load_model(str(folder), device="cpu")


def test_folder_without_tokenizer_is_a_clear_error(tmp_path, tiny_llama_dir):
    folder = tmp_path / "notok"
    shutil.copytree(tiny_llama_dir, folder)
    (folder / "tokenizer.json").unlink()
    with pytest.raises(ModelLoadError, match=r"tokenizer\.json"):
        load_model(str(folder), device="cpu")


def test_cli_reports_a_bad_model_in_one_line_without_traceback(tmp_path):
    done = run_cli("ask", "hi", "--model", str(tmp_path / "missing.gguf"), env_home=tmp_path)
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert done.stderr.startswith("kvchat: No model found")


def test_cli_reports_a_prompt_longer_than_the_context(tmp_path, tiny_llama_dir):
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    question = "word " * (config["max_position_embeddings"] + 10)
    done = run_cli(
        "ask", question, "--model", str(tiny_llama_dir), "--dtype", "float32",
        "--device-cache", "16MiB", "--host-cache", "0", env_home=tmp_path,
    )  # fmt: skip
    assert done.returncode == 1
    assert "Traceback" not in done.stderr
    assert "context" in done.stderr


@pytest.mark.skipif(
    __import__("torch").cuda.is_available(), reason="needs a torch that cannot use CUDA"
)
def test_a_gpu_torch_cannot_use_is_refused_in_one_line_before_any_conversion(
    tmp_path, tiny_llama_dir
):
    done = run_cli(
        "ask", "--model", str(tiny_llama_dir), "--device", "cuda", "hi", env_home=tmp_path
    )
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert "--device cuda:" in done.stderr and "Leave --device out" in done.stderr
    assert not (tmp_path / "cache" / "models").exists() or not any(
        (tmp_path / "cache" / "models").rglob("*.safetensors")
    )
    other = run_cli(
        "ask", "--model", str(tiny_llama_dir), "--device", "mps", "hi", env_home=tmp_path
    )
    assert other.returncode == 2 and "must be cpu or cuda" in other.stderr


def test_every_command_keeps_unexpected_errors_in_the_log(tmp_path, monkeypatch):
    """The error log the message points at exists whatever the command (not only the TUI)."""
    import kvchat.cli as cli
    from kvchat.paths import app_paths

    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path))

    def broken(_args):
        raise ValueError("a bug")

    monkeypatch.setattr("kvchat.ask.run_ask", broken)
    assert cli.main(["ask", "hi"]) == 1
    import logging

    for handler in logging.getLogger("kvchat").handlers:
        handler.flush()
    assert "ValueError: a bug" in app_paths().error_log.read_text()
