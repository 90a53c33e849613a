"""What the bench knows of a workload: its name, how it runs, how its table reads.

Each workload's module ends with one `Workload`, and the registry (`__init__.py`) lists
them in the order the suite runs them and the report prints them. The runner only calls
`run`; the report only calls `table` (and `chart`, where there is one), so the code that
measures a workload and the code that shows it sit side by side in one file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvchat.bench.workloads.context import BenchContext


@dataclass(frozen=True)
class Chart:
    """A PNG the report writes from one workload's JSON."""

    title: str  # the report's alt text for it
    file_name: str
    # (the workload's JSON, with numbers from at least one engine; the PNG's path) -> why the
    # chart was not written, or None
    plot: Callable[[dict, Path], str | None]


@dataclass(frozen=True)
class Workload:
    """One workload of the suite, as the runner and the report see it."""

    name: str  # as `--workloads` and the JSON's "workloads" name it
    run: Callable[[BenchContext], dict]  # the JSON-ready result (`repeats.repeat_interleaved`)
    table: Callable[[dict], list[str]]  # the report's section, given an engine produced numbers
    chart: Chart | None = None
