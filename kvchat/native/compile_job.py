"""The kernel build as a process of its own: it outlives the kvchat that started it.

A short `kvchat ask` exits long before a ~20 s compile would end; a thread of its would
die with it, so a user who runs only short commands would never get the kernels. This
script is started detached (its own session, so a terminal's ctrl+c or hangup does not
reach it) by `build.py` and runs niced (`lower_priority`), so the engine keeps most of the
cores while it compiles. It holds an exclusive lock on the cache folder's `build.lock` while it
runs, with its start time written in it: a second job waits for the lock and then finds
the library built, so two kvchat processes started together compile once. Objects are
compiled in a private `.build-*` folder, one compiler per core, linked there
and moved into place atomically; the folder is removed whatever happens, and any left
by a build that was killed is removed by the next one (or by any kvchat's start).

Only the standard library is imported (no torch): it starts in milliseconds. The plan
arrives as one JSON argument (see `build.BuildPlan`).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LOCK_NAME = "build.lock"
ERROR_NAME = "build-error.txt"
WORK_PREFIX = ".build-"


BUILD_NICENESS = 10


def lower_priority() -> None:
    """Nice 10 (the compiler children inherit it): a busy engine keeps about nine tenths of
    each core, and the build still ends under load. Idle scheduling starved it instead:
    a headless script or a CI run that keeps both cores busy never got the kernels, and
    without them float32 decode runs the reference loop at a seventh of the speed."""
    with contextlib.suppress(OSError):
        os.nice(BUILD_NICENESS - os.nice(0))


def remove_leftovers(folder: Path) -> None:
    """What a killed build left: work folders, and the temporary libraries of older
    versions of kvchat, which compiled straight into the cache folder."""
    for path in folder.iterdir():
        if path.name.startswith(WORK_PREFIX) and path.is_dir():
            shutil.rmtree(path, ignore_errors=True)
        elif path.name.startswith("tmp") and path.suffix == ".so":
            path.unlink(missing_ok=True)


def sweep(folder: Path) -> None:
    """Remove a killed build's leftovers now, unless a build is running in `folder`."""
    try:
        with open(folder / LOCK_NAME, "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            remove_leftovers(folder)
    except (BlockingIOError, FileNotFoundError):
        pass  # a build runs (it sweeps itself), or nothing was ever built here


def parallel_compiles() -> int:
    """One compiler per core: they run niced, so a kvchat answering beside them keeps most
    of its cores, and the kernels arrive as soon as the machine allows."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def compile_all(plan: dict, work: Path) -> Path:
    """Compile each source to an object (a few at a time), link them, return the library."""
    objects = [work / (Path(source).stem + ".o") for source in plan["sources"]]
    pending = list(zip(plan["sources"], objects, strict=True))
    running: list[subprocess.Popen] = []
    errors: list[str] = []

    def finish(process: subprocess.Popen) -> None:
        _, stderr = process.communicate(timeout=1800)
        if process.returncode != 0:
            errors.append(stderr.strip()[-2000:] or "the compiler failed")

    while pending or running:
        while pending and len(running) < parallel_compiles():
            source, obj = pending.pop(0)
            cmd = [plan["compiler"], *plan["compile_flags"], "-c", source, "-o", str(obj)]
            running.append(subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True))
        finish(running.pop(0))
    if errors:
        raise RuntimeError("\n".join(errors))
    library = work / "kernels.so"
    # the libraries after the objects: linkers that drop unneeded ones read in order
    link = [plan["compiler"], *map(str, objects), *plan["link_flags"], "-o", str(library)]
    for extra in plan["link_extras"]:  # e.g. glibc's vector math library, where present
        done = subprocess.run([*link, *extra], capture_output=True, text=True, timeout=600)
        if done.returncode == 0:
            return library
    raise RuntimeError(done.stderr.strip()[-2000:] or "the linker failed")


def run(plan: dict) -> int:
    target = Path(plan["target"])
    folder = target.parent
    folder.mkdir(parents=True, exist_ok=True)
    lower_priority()
    with open(folder / LOCK_NAME, "a") as lock:
        # Blocking: a job that finds another one building waits for it and then finds the
        # library there (the non-blocking probe of `build.py` may hold the lock a moment).
        fcntl.flock(lock, fcntl.LOCK_EX)
        if target.exists():
            return 0
        lock.truncate(0)  # when this build started, for the start-up line of other runs
        lock.write(f"{time.time():.3f}\n")
        lock.flush()
        remove_leftovers(folder)
        work = Path(tempfile.mkdtemp(prefix=WORK_PREFIX, dir=folder))
        try:
            library = compile_all(plan, work)
            os.replace(library, target)
            (folder / ERROR_NAME).unlink(missing_ok=True)
            return 0
        except Exception as exc:  # kept for the start-up line of every later run
            with contextlib.suppress(OSError):
                (folder / ERROR_NAME).write_text(str(exc) or type(exc).__name__)
            return 1
        finally:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(run(json.loads(sys.argv[1])))
