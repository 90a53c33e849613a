"""Where a bench run's numbers come from: kvchat's version and commit, the command line.

A result is only worth keeping if a stranger can tell what produced it, so every
`bench.json` records them beside the machine (`machine.py`). Nothing recorded may
name the machine's own folders: absolute paths are reduced to their last part
(`/home/me/models/x.gguf` -> `x.gguf`), so results can be committed and shared.
"""

from __future__ import annotations

import datetime as dt
import re
import subprocess
from collections.abc import Sequence
from importlib import metadata
from pathlib import Path

REPOSITORY = Path(__file__).resolve().parents[2]  # the checkout kvchat runs from, if any


def kvchat_version() -> str:
    try:
        return metadata.version("kvchat")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown"


def git_revision(folder: Path = REPOSITORY) -> dict[str, object] | None:
    """The commit kvchat's source tree is at and whether it has local changes; None outside git."""
    try:
        commit = _git(folder, "rev-parse", "HEAD")
        status = _git(folder, "status", "--porcelain", "--untracked-files=no")
    except (OSError, subprocess.SubprocessError):
        return None
    return {"commit": commit, "dirty": bool(status)}


def _git(folder: Path, *args: str) -> str:
    done = subprocess.run(
        ["git", "-C", str(folder), *args],
        capture_output=True,
        text=True,
        timeout=10,
        check=True,
    )
    return done.stdout.strip()


def without_folders(value: str) -> str:
    """An absolute path reduced to its last part; anything else unchanged."""
    return Path(value).name if Path(value).is_absolute() else value


def command_line(argv: Sequence[str]) -> str:
    """`kvchat ARGS...` as typed, with absolute paths reduced to their last part."""
    parts = ["kvchat"]
    for arg in argv:
        if arg.startswith("--") and "=" in arg:
            flag, value = arg.split("=", 1)
            arg = f"{flag}={without_folders(value)}"
        else:
            arg = without_folders(arg)
        parts.append(_quoted(arg))
    return " ".join(parts)


def _quoted(arg: str) -> str:
    return arg if re.fullmatch(r"[\w@%+=:,./-]+", arg) else "'" + arg.replace("'", "'\\''") + "'"


def cpu_slug(cpu: str) -> str:
    """A folder-friendly name for a CPU model: 'Intel(R) Xeon(R) Processor' -> 'intel-xeon'."""
    text = re.sub(r"\((R|TM|tm)\)", " ", cpu)
    text = re.sub(r"@.*$", " ", text)  # the clock speed
    words = [w for w in re.split(r"[^A-Za-z0-9]+", text.lower()) if w]
    words = [w for w in words if w not in ("processor", "cpu")]
    return "-".join(words) or "cpu"


def default_out(cpu: str, now: dt.datetime | None = None) -> Path:
    """Where a run goes unless `--out` says otherwise: git-ignored, one folder per run."""
    now = now or dt.datetime.now(dt.UTC)
    return Path("benchmarks") / "runs" / f"{now:%Y-%m-%d-%H%M}-{cpu_slug(cpu)}"
