"""The servers cache: where the serving engines built for tests and benchmarks live.

Building llama-server takes minutes and vLLM's venv takes gigabytes, so they are
built once per user into one folder outside any checkout, shared by every clone,
the tests, the benchmarks and CI, as pip's cache is: `KVCHAT_SERVERS_DIR`, else
`$XDG_CACHE_HOME/kvchat-servers` (`~/.cache/kvchat-servers`). Each engine has a
folder of its own named by what it was built from, so versions and machines sharing
a home do not replace each other's: `llama-server-VERSION-KEY/` (KEY: a hash of the
CPU features it was built for), `vllm-venv-VERSION/`, `router-venv-VERSION/`. It is
not under kvchat's own cache folder (`kvchat.paths`), which holds the user's data
and which the tests must never change.

benchmarks/servers/build_llama_server.sh and install_vllm.sh compute the same folder
in bash (they run without kvchat installed): keep the three in sync.
"""

from __future__ import annotations

import os
from pathlib import Path

FOLDER_NAME = "kvchat-servers"


def servers_dir() -> Path:
    """KVCHAT_SERVERS_DIR, else `$XDG_CACHE_HOME/kvchat-servers` (`~/.cache/kvchat-servers`)."""
    if os.environ.get("KVCHAT_SERVERS_DIR"):
        return Path(os.environ["KVCHAT_SERVERS_DIR"])
    cache = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(cache) / FOLDER_NAME
