"""Models that attend within a window (Mistral 7B v0.1, Phi-3-mini, Qwen with
use_sliding_window) run with their context capped at the window, where windowed and
full attention are one computation: greedy text equals transformers', the cap is said
at start, and a window beyond the context (Phi-4-mini's) is no window at all."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from kvchat.model.config import ModelConfig
from kvchat.model.loader import load_model
from tests.engine_helpers import generate, small_engine
from tests.tiny_models import write_tiny_model

WINDOW = 64


@pytest.mark.parametrize(
    ("model_type", "extra", "window"),
    [
        ("mistral", {}, WINDOW),
        ("phi3", {}, WINDOW),
        ("qwen3", {"use_sliding_window": True}, WINDOW),
        ("qwen3", {}, None),  # qwen's window is off unless switched on
        ("phi3", {"sliding_window": 4096}, None),  # beyond the context: no window
    ],
)
def test_the_window_is_read_where_it_takes_effect(tiny_llama_dir, model_type, extra, window):
    raw = json.loads((tiny_llama_dir / "config.json").read_text())
    raw.update({"model_type": model_type, "sliding_window": WINDOW, **extra})
    assert ModelConfig.from_dict(raw).sliding_window == window


def test_a_windowed_model_runs_its_window_as_transformers_computes_it(tmp_path):
    folder = write_tiny_model(tmp_path / "mistral", "llama")
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=WINDOW)
    (folder / "config.json").write_text(json.dumps(config))
    model = load_model(str(folder), dtype="float32", device="cpu")
    with small_engine(model) as engine:
        assert engine.context_length == WINDOW
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(7)).tolist()
    with torch.no_grad():
        out = hf.generate(
            torch.tensor([ids]), max_new_tokens=23, min_new_tokens=23, do_sample=False
        )
    assert generate(model, ids, max_tokens=23, ignore_eos=True) == out[0, len(ids) :].tolist()


def test_the_cap_is_said_at_start(tmp_path, tiny_llama_dir):
    from kvchat.cli import main

    folder = tmp_path / "mistral"
    shutil.copytree(tiny_llama_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="mistral", sliding_window=WINDOW * 4)
    (folder / "config.json").write_text(json.dumps(config))
    import contextlib
    import io

    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        code = main(
            ["ask", "hi", "--model", str(folder), "--dtype", "float32", "--max-tokens", "2",
             "--device-cache", "16MiB", "--host-cache", "0", "--disk-cache", "0"]
        )  # fmt: skip
    assert code == 0, err.getvalue()
    assert "attends to the last 256 tokens only" in err.getvalue()
