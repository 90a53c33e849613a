"""llama-server and kvchat on the same GGUF: the same greedy tokens (the family GGUF tests'
agreement with llama.cpp's own engine)."""

from __future__ import annotations

import pytest
import torch

from kvchat.model.loader import load_model
from tests.tiny_models import PHI3_ORIGINAL_CONTEXT


def assert_llama_server_writes_kvchats_tokens(gguf, family: str) -> None:
    import json
    import urllib.request

    from tests.engine_helpers import generate
    from tests.servers import Unavailable, start_llama_server

    try:
        server = start_llama_server(gguf, slots=1, ctx=PHI3_ORIGINAL_CONTEXT)
    except Unavailable as exc:
        pytest.skip(f"llama-server cannot be built or started here: {exc}")
    ids = torch.randint(3, 1000, (40,), generator=torch.Generator().manual_seed(9)).tolist()
    try:
        body = {
            "prompt": ids, "n_predict": 12, "temperature": 0, "top_k": 1, "ignore_eos": True,
            "cache_prompt": False, "return_tokens": True,
        }  # fmt: skip
        request = urllib.request.Request(
            server.root + "/completion",
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as response:
            theirs = json.load(response)["tokens"]
    finally:
        server.stop()
    model = load_model(str(gguf), dtype="float32", device="cpu")
    if family == "gpt_oss":
        rounding_yarn_bounds_as_llama_cpp(model)
    ours = generate(
        model, ids, max_tokens=12, ignore_eos=True, context_tokens=PHI3_ORIGINAL_CONTEXT
    )
    assert ours == theirs


def rounding_yarn_bounds_as_llama_cpp(model) -> None:
    """llama.cpp rounds YaRN's ramp bounds outward to whole dimensions for every model;
    transformers' gpt-oss (and kvchat, reading the file as gpt-oss's config says) does
    not. With the rounding, llama-server's logits on this file are kvchat's to 0.002;
    without it, the tiny model's ramp (over dimensions 0 to 1.56, rounded to 2) differs
    enough to change its greedy tokens."""
    from dataclasses import replace

    from kvchat.model.rope import RotaryTable

    t = model.transformer
    t.config = replace(t.config, rope_scaling=replace(t.config.rope_scaling, truncate=True))
    t.rotary = RotaryTable(t.config, t.max_positions, t.dtype, t.device)
