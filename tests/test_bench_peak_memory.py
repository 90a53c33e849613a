"""Peak memory of the bench's engine processes: each reading sees memory a process
really touched, counts that process (or process group) and not the bench's own, and the
report shows it beside the engines' speed without changing older results' tables.

The children allocate a known amount and write every page of it, so the readings have
a floor to clear; the ceilings check that the bench's own memory is not counted in.
"""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvchat.bench import peak_memory
from kvchat.bench.peak_memory import BENCH_PROCESS, PeakRss, engine_peak, run_measured
from kvchat.bench.report import markdown
from kvchat.bench.table import peak_rss_columns, peak_rss_note
from kvchat.bench.workloads.repeats import record_peaks

MB = 1 << 20
N = 256  # MB a child allocates
# a child that writes N MB (every page touched), then waits for `sleep` seconds
ALLOCATE = "import sys, time\nheld = b'x' * ({n} << 20)\ntime.sleep(float(sys.argv[1]))\n"
RESULTS = sorted(
    (Path(__file__).resolve().parents[1] / "benchmarks" / "results").glob("*/bench.json")
)


def _rss_now() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def test_a_waited_child_that_allocates_n_mb_shows_a_peak_of_at_least_n_mb_and_not_ours():
    held = b"y" * (2 * N * MB)  # the bench's own memory, larger than the child's
    done = run_measured(
        [sys.executable, "-c", ALLOCATE.format(n=N) + "print('done')", "0.5"], timeout=120
    )
    assert (done.returncode, done.stdout.strip()) == (0, "done")
    assert N * MB <= done.peak_bytes < N * MB + 200 * MB  # the child alone: not `held`
    assert len(held) == 2 * N * MB


def test_a_small_child_shows_a_small_peak_however_large_the_bench_is():
    """A child's rusage would start from the bench's own high-water mark (vfork)."""
    held = b"y" * (2 * N * MB)
    assert peak_memory.own_peak() > 2 * N * MB
    done = run_measured([sys.executable, "-c", "import time; time.sleep(1)"], timeout=120)
    assert done.returncode == 0 and 0 < done.peak_bytes < 100 * MB
    assert len(held) == 2 * N * MB


def test_a_child_past_its_time_is_killed_and_the_timeout_raised():
    start = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired):
        run_measured(["sleep", "30"], timeout=0.5)
    assert time.monotonic() - start < 10


def test_a_failing_child_gives_its_exit_code_and_error_output():
    done = run_measured([sys.executable, "-c", "import sys; sys.exit('bad input')"], timeout=60)
    assert done.returncode == 1 and "bad input" in done.stderr


def test_the_bench_process_peak_covers_what_it_holds_now():
    before = _rss_now()
    held = b"z" * (N * MB)
    # the kernel syncs its resident counters every few dozen page faults: a little slack
    assert peak_memory.own_peak() >= max(before, _rss_now()) - 4 * MB >= N * MB
    shared = engine_peak(object())  # a peer without a process of its own
    assert shared is not None and (shared.process, shared.shared) == (BENCH_PROCESS, True)
    assert shared.bytes >= N * MB
    del held


def test_a_servers_peak_adds_its_process_groups_and_ends_with_it():
    """A parent that starts a child allocating N MB, both in a group of their own, as
    vLLM's server and its engine core are."""
    code = (
        "import subprocess, sys, time\n"
        f"child = subprocess.Popen([sys.executable, '-c', {ALLOCATE.format(n=N)!r}, '60'])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    try:
        child = int(parent.stdout.readline())
        deadline = time.monotonic() + 60
        while (peak_memory.status_peak(child) or 0) < N * MB:
            assert time.monotonic() < deadline, "the child did not allocate in time"
            time.sleep(0.1)
        group = peak_memory.group_peak(parent.pid)
        alone = peak_memory.status_peak(parent.pid)
        assert alone is not None and alone < N * MB  # the parent alone holds little
        assert group is not None and group >= N * MB + alone
        assert peak_memory.group_peak(os.getpgrp()) != group  # only that group counted
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait(10)
    deadline = time.monotonic() + 10
    while peak_memory.group_peak(parent.pid) is not None and time.monotonic() < deadline:
        time.sleep(0.1)  # the child is reaped by init once its parent is gone
    assert peak_memory.group_peak(parent.pid) is None
    assert peak_memory.status_peak(parent.pid) is None


class _ChildPeer:
    def peak_rss(self) -> PeakRss | None:
        return PeakRss(3 * 2**30, "llama-bench", shared=False)


class _RemotePeer:
    def peak_rss(self) -> None:
        return None


def test_each_engine_gets_its_own_processs_peak_and_in_process_ones_share_the_benchs():
    out = {"engines": {n: {"median": {}} for n in ("kvchat", "llama-bench", "kvchat@vllm")}}
    record_peaks(
        out, {"kvchat": object(), "llama-bench": _ChildPeer(), "kvchat@vllm": _RemotePeer()}
    )
    engines = out["engines"]
    assert engines["llama-bench"]["peak_rss"] == {
        "bytes": 3 * 2**30, "process": "llama-bench", "shared": False,
    }  # fmt: skip
    assert engines["kvchat"]["peak_rss"]["process"] == BENCH_PROCESS
    assert engines["kvchat"]["peak_rss"]["shared"] is True
    assert engines["kvchat"]["peak_rss"]["bytes"] >= _rss_now()
    assert "peak_rss" not in engines["kvchat@vllm"]  # a server the bench did not start
    json.dumps(out)  # the results stay JSON


def test_the_peak_column_is_in_gib_and_says_which_engines_share_the_benchs_process():
    engines = {
        "kvchat": {"peak_rss": {"bytes": 3 << 29, "process": "bench", "shared": True}},
        "transformers": {"peak_rss": {"bytes": 3 << 29, "process": "bench", "shared": True}},
        "llama-bench": {"peak_rss": {"bytes": 1 << 29, "process": "llama-bench", "shared": False}},
        "kvchat@vllm": {},
    }
    (column,) = peak_rss_columns(engines)
    assert column.header == "peak RSS (GiB)"
    cells = [column.cell(e) for e in engines.values()]
    assert cells == ["1.50 (the bench's process)", "1.50 (the bench's process)", "0.50", "—"]
    note = peak_rss_note(engines)[1]
    assert "kvchat, transformers run in the bench's own process" in note
    assert peak_rss_columns({"kvchat": {}}) == [] and peak_rss_note({"kvchat": {}}) == []


@pytest.fixture
def results() -> dict:
    if not RESULTS:
        pytest.skip("no committed bench results")
    return json.loads(RESULTS[0].read_text(encoding="utf-8"))


def test_results_without_peaks_render_as_before_and_with_them_gain_only_the_column(results):
    old = markdown(copy.deepcopy(results))
    assert "peak RSS" not in old
    with_peaks = copy.deepcopy(results)
    speed = with_peaks["workloads"]["speed"]["engines"]
    for entry in speed.values():
        entry["peak_rss"] = {"bytes": 2**30, "process": "bench", "shared": True}
    new = markdown(with_peaks)
    old_speed = old.split("## Speed", 1)[1].split("\n## ", 1)
    new_speed = new.split("## Speed", 1)[1].split("\n## ", 1)
    assert old_speed[1] == new_speed[1]  # the other workloads' sections are unchanged
    old_rows = [line for line in old_speed[0].splitlines() if line.startswith("|")]
    new_rows = [line for line in new_speed[0].splitlines() if line.startswith("|")]
    assert new_rows[0] == old_rows[0] + " peak RSS (GiB) |"
    assert all(n.startswith(o) for o, n in zip(old_rows, new_rows, strict=True))
    assert "1.00 (the bench's process)" in new_rows[2]
    assert "Peak RSS: " in new_speed[0]
