"""kvchat's kernel build outlives the process that asked for it, runs once per cache
folder, and leaves nothing behind but the library.

Each test has a fresh cache folder (the per-test `KVCHAT_HOME`) and a compiler wrapper
that logs every compile and can be told to hang, so a build can be counted and killed
part-way. The wrapper answers `--version` as the real compiler does, so the kernels it
builds are the ones kvchat would build.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvchat.native import build as native_build
from kvchat.native import compile_job

pytestmark = pytest.mark.skipif(
    native_build._compiler() is None or native_build.disabled() or sys.platform == "win32",
    reason="no C++ compiler here (or kvchat's kernels are turned off)",
)

LOADED = "kvchat's CPU kernels ("
COMPILING = "while kvchat's kernels compile"


@pytest.fixture
def compiler(tmp_path, monkeypatch) -> Path:
    """A wrapper around the real compiler that logs each compile (`-c`) to `compiles.log`,
    and hangs before compiling while `hang` exists beside it."""
    real = native_build._compiler()
    wrapper = tmp_path / "logged-c++"
    log = tmp_path / "compiles.log"
    wrapper.write_text(
        "#!/bin/sh\n"
        'case " $* " in *" -c "*)\n'
        f'  echo "$*" >> "{log}"\n'
        f'  while [ -e "{tmp_path / "hang"}" ]; do sleep 0.2; done;;\n'
        "esac\n"
        f'exec {real} "$@"\n'
    )
    wrapper.chmod(0o755)
    monkeypatch.setenv("CXX", str(wrapper))
    return wrapper


def compiles(wrapper: Path) -> list[str]:
    log = wrapper.parent / "compiles.log"
    return log.read_text().splitlines() if log.exists() else []


@pytest.fixture(autouse=True)
def fresh_kernel_cache(monkeypatch) -> None:
    """This test's own kernel cache (its kvchat folder's), not the run's shared one."""
    monkeypatch.delenv(native_build.CACHE_ENV, raising=False)


def native_folder(kvchat_home: Path) -> Path:
    return kvchat_home / "cache" / "native"


def leftovers(folder: Path) -> list[str]:
    """Everything in the kernel cache that is not a library, its lock or its error note."""
    keep = {native_build.LIBRARY_NAME, compile_job.LOCK_NAME, compile_job.ERROR_NAME}
    return sorted(str(p) for p in folder.rglob("*") if p.is_file() and p.name not in keep)


def load_in_a_new_process(**popen) -> subprocess.Popen:
    """A process that loads (building if needed) the kernels and prints whether it did."""
    code = (
        "from kvchat.native import build\n"
        "build.request(wait=True)\n"
        "print(build.status().loaded, build.status().detail)\n"
    )
    return subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, **popen
    )


def test_two_processes_started_together_build_once(compiler, kvchat_home) -> None:
    first, second = load_in_a_new_process(), load_in_a_new_process()
    outputs = [p.communicate(timeout=600)[0] for p in (first, second)]
    assert all(out.startswith("True") for out in outputs), outputs
    assert len(compiles(compiler)) == len(native_build.SOURCES)  # one compile of each source
    libraries = list(native_folder(kvchat_home).rglob(native_build.LIBRARY_NAME))
    assert len(libraries) == 1
    assert leftovers(native_folder(kvchat_home)) == []


def test_a_build_killed_part_way_leaves_nothing_once_the_next_kvchat_starts(
    compiler, kvchat_home
) -> None:
    hang = compiler.parent / "hang"
    hang.touch()
    plan = native_build.plan_build(str(compiler))
    Path(plan.target).parent.mkdir(parents=True, exist_ok=True)
    job = native_build.start_build(plan)
    folder = Path(plan.target).parent
    deadline = time.monotonic() + 60
    while not (list(folder.glob(compile_job.WORK_PREFIX + "*")) and compiles(compiler)):
        assert time.monotonic() < deadline, "the build never started compiling"
        time.sleep(0.1)
    os.killpg(job.pid, signal.SIGKILL)  # the job and its compilers: its own session
    job.wait(timeout=30)
    assert list(folder.glob(compile_job.WORK_PREFIX + "*"))  # what the kill left
    hang.unlink()

    after = load_in_a_new_process()
    out = after.communicate(timeout=600)[0]
    assert out.startswith("True"), out
    assert leftovers(native_folder(kvchat_home)) == []
    assert Path(plan.target).exists()

    # leftovers found beside a library that is already there go at the next start too
    built = len(compiles(compiler))
    (folder / (compile_job.WORK_PREFIX + "x")).mkdir()
    (folder / (compile_job.WORK_PREFIX + "x") / "decoder_ops.o").write_bytes(b"half")
    (folder / "tmpab12cd.so").write_bytes(b"an older kvchat's temporary library")
    out = load_in_a_new_process().communicate(timeout=120)[0]
    assert out.startswith("True"), out
    assert leftovers(native_folder(kvchat_home)) == []
    assert len(compiles(compiler)) == built  # loaded, not built again


def test_a_failed_build_says_why_and_leaves_no_file(tmp_path, kvchat_home, monkeypatch) -> None:
    broken = tmp_path / "broken-c++"
    real = native_build._compiler()
    broken.write_text(
        "#!/bin/sh\n"
        f'case " $* " in *" -c "*) echo "fatal: no space left" >&2; exit 1;; esac\n'
        f'exec {real} "$@"\n'
    )
    broken.chmod(0o755)
    monkeypatch.setenv("CXX", str(broken))
    process = load_in_a_new_process()
    out = process.communicate(timeout=600)[0]
    assert out.startswith("False") and "no space left" in out, out
    assert leftovers(native_folder(kvchat_home)) == []
    # the next start does not retry at once: it says why, from the note the build left
    again = load_in_a_new_process().communicate(timeout=120)[0]
    assert again.startswith("False") and "no space left" in again, again


def test_the_start_up_line_says_since_when_a_build_runs(monkeypatch) -> None:
    class Alive:
        @staticmethod
        def is_alive() -> bool:
            return True

    monkeypatch.setattr(native_build._State, "loaded", False)
    monkeypatch.setattr(native_build._State, "building", Alive())
    monkeypatch.setattr(native_build._State, "since", time.mktime((2026, 1, 2, 9, 8, 7, 0, 0, -1)))
    line = native_build.summary(native_build.torch.device("cpu"))
    assert "compile" in line and "since 09:08:07" in line


def short_run_attention_line() -> str:
    """Run `kvchat ask --max-tokens 2` and return its start-up line's attention part."""
    done = subprocess.run(
        [sys.executable, "-m", "kvchat", "ask", "--max-tokens", "2", "Hi"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    return next(line for line in done.stderr.splitlines() if "attention:" in line)


@pytest.mark.real_model
def test_short_runs_get_the_kernels_once_one_build_ends(
    compiler, kvchat_home, default_gguf_path
) -> None:
    """`kvchat ask --max-tokens 2` again and again, each far shorter than the build: the
    build the first one started finishes anyway (under the load of the runs themselves),
    later runs load its library, and the cache folder ends with one library and nothing
    else. Runs go on until one loads it, for at most five minutes."""
    lines: list[str] = []
    deadline = time.monotonic() + 300
    while not (lines and LOADED in lines[-1]) and time.monotonic() < deadline:
        lines.append(short_run_attention_line())
    for _ in range(2):  # once there, always there
        lines.append(short_run_attention_line())
    states = ["loaded" if LOADED in line else "compiling" for line in lines]
    assert COMPILING in lines[0]
    assert "loaded" in states, lines  # the build ended while short runs kept the cores busy
    first = states.index("loaded")
    assert states[first:] == ["loaded"] * (len(states) - first), lines
    assert len(compiles(compiler)) == len(native_build.SOURCES)  # one build for all of them
    assert len(list(native_folder(kvchat_home).rglob(native_build.LIBRARY_NAME))) == 1
    assert leftovers(native_folder(kvchat_home)) == []


def test_the_build_runs_niced_not_starved() -> None:
    """Nice 10 in the job and so in its compilers: idle scheduling would let a busy engine
    starve the build for as long as it runs."""
    code = (
        "import os\n"
        "from kvchat.native import compile_job\n"
        "compile_job.lower_priority()\n"
        "print(os.nice(0), os.sched_getscheduler(0) == os.SCHED_OTHER)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == [str(compile_job.BUILD_NICENESS), "True"]
