"""Where the built serving engines for tests and benchmarks live (`.servers/`, git-ignored).

Building llama-server takes many minutes, so the git worktrees of one clone share
the main checkout's build instead of each building its own: a checkout without a
build reuses the main checkout's (never builds there). `KVCHAT_SERVERS_DIR` overrides.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

BUILT_MARK = "llama-server/bin"  # present once a build finished


def main_checkout_servers(root: Path) -> Path | None:
    """`.servers/` of the clone's main checkout, when `root` is a git worktree of it."""
    try:
        common = subprocess.run(
            ["git", "-C", str(root), "rev-parse", "--path-format=absolute", "--git-common-dir"],
            capture_output=True,
            text=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    main = Path(common).parent / ".servers" if common else None
    return main if main is not None and main.resolve() != (root / ".servers").resolve() else None


def servers_dir(root: Path) -> Path:
    """KVCHAT_SERVERS_DIR, else `root/.servers/`, else the main checkout's if only it is built."""
    if os.environ.get("KVCHAT_SERVERS_DIR"):
        return Path(os.environ["KVCHAT_SERVERS_DIR"])
    own = root / ".servers"
    shared = main_checkout_servers(root)
    if not (own / BUILT_MARK).exists() and shared is not None and (shared / BUILT_MARK).exists():
        return shared
    return own
