"""Whether another process is still running: used to tell a crashed writer from a live one."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """Whether a process with this pid exists (a zombie counts: reap children first)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    except OSError:
        return False
    return True
