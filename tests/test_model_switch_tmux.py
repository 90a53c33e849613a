"""Switching model in a real terminal (tmux): f5 opens the picker over what the
`model_dirs` setting holds, enter loads the model chosen, and the next reply comes from
it, the session kept."""

from __future__ import annotations

import shutil

import pytest

from tests.tmux_helpers import ready

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux is not installed"),
]


def test_f5_switches_to_another_model_of_the_machine(
    tmp_path, tiny_llama_dir, tiny_qwen2_dir, terminals
):
    home = tmp_path / "home"
    (home / "config").mkdir(parents=True)
    shutil.copytree(tiny_qwen2_dir, tmp_path / "models" / "other-model")
    (home / "config" / "settings.toml").write_text(f'model_dirs = ["{tmp_path / "models"}"]\n')
    stores = {  # no store of the user's is read
        name: str(tmp_path / name.lower()) for name in ("HOME", "HF_HOME", "OLLAMA_MODELS")
    }
    term = terminals(home, tiny_llama_dir, "--max-tokens", "8", env=stores)
    ready(term)
    term.type("first question")
    term.wait(lambda s: "Assistant" in s and " idle " in s, "the first reply")
    term.keys("F5")
    term.wait(lambda s: "Run another model" in s and "other-model" in s, "the picker")
    term.keys("Enter")
    term.wait(lambda s: "Now running other-model" in s, "the switch", timeout=120)
    term.wait(lambda s: "other-model: KV cache" in s, "the meters' note of the new model")
    term.type("second question")
    term.wait(
        lambda s: s.count("Assistant") >= 2 and " idle " in s and "second question" in s,
        "the reply of the new model, in the same session",
    )
    term.keys("C-q")
    term.wait_text("KVCHAT-EXITED-0")
