"""The bench's workloads (docs/benchmarks.md), one module each, by the name `--workloads` takes.

Each module holds one workload whole: how it runs on every engine that can run it,
and the report's table (and chart) of its numbers. `WORKLOADS` lists them in the
order the suite runs them and the report prints them. What they share lives beside
them: the sizes (`plan.py`), what they are given (`context.py`), the interleaved
repeats and medians (`repeats.py`); the tables' format is `kvchat/bench/table.py`.
"""

from __future__ import annotations

from kvchat.bench.workloads.speed_prefill_decode import SPEED
from kvchat.bench.workloads.sweep_switch_cost import SWEEP
from kvchat.bench.workloads.w1_session_switching import W1
from kvchat.bench.workloads.w2_concurrency import W2
from kvchat.bench.workloads.w3_ingest_interference import W3
from kvchat.bench.workloads.w4_memory_pressure import W4
from kvchat.bench.workloads.w5_restart import W5
from kvchat.bench.workloads.w6_more_than_ram_holds import W6
from kvchat.bench.workloads.w7_paste_then_ask import W7
from kvchat.bench.workloads.workload import Workload

WORKLOADS: dict[str, Workload] = {w.name: w for w in (SPEED, W1, SWEEP, W2, W3, W4, W5, W6, W7)}
WORKLOAD_NAMES = tuple(WORKLOADS)
