"""The folder the tests share across runs: the real default model and compiled kernels.

`KVCHAT_TEST_CACHE`, default ~/.cache/kvchat-test; never the user's own kvchat folders.
"""

from __future__ import annotations

import os
from pathlib import Path

TEST_CACHE = Path(os.environ.get("KVCHAT_TEST_CACHE", Path.home() / ".cache" / "kvchat-test"))
# The kernels the session builds once (conftest's `native_kernels`), where every kvchat
# of a run keeps them (`KVCHAT_KERNEL_CACHE`).
NATIVE_CACHE = TEST_CACHE.parent / "kvchat-test-native" / "cache" / "native"
