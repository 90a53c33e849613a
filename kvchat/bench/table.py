"""The report's Markdown tables: one number format, and one row per engine of a workload.

Every workload's table is the same shape: the engine (or configuration) on the left,
then one cell per column, each read from that engine's entry in the JSON. A `Column`
names its header and how its cell is read, so a workload's table is a list of columns
rather than a loop of its own, and every number in the report is formatted alike.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

MISSING = "—"  # a number the run did not record


def number(value: object, digits: int = 2) -> str:
    """A figure as the report prints it: thousands separated, large floats without decimals."""
    if value is None:
        return MISSING
    if isinstance(value, float):
        if abs(value) >= 100:
            return f"{value:,.0f}"
        return f"{value:.{digits}f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    """A Markdown table's lines: the header, its rule, then one line per row."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


@dataclass(frozen=True)
class Column:
    """One column of an engine table: its header and its cell from an engine's entry.

    The entry is the JSON's `{"runs": [...], "median": {...}, ...}` for one engine, so a
    cell may read the medians or a figure computed across engines beside them.
    """

    header: str
    cell: Callable[[dict], str]


def median_number(header: str, key: str, digits: int = 2) -> Column:
    """The median of `key`, formatted by `number`."""
    return Column(header, lambda entry: number(entry["median"][key], digits))


def median_ms(header: str, key: str) -> Column:
    """The median of `key`, a time in seconds, in milliseconds with one decimal."""
    return Column(header, lambda entry: number(entry["median"][key] * 1000, 1))


def median_ratio(header: str, key: str) -> Column:
    """The median of `key`, a ratio, as `1.23x`."""
    return Column(header, lambda entry: f"{entry['median'][key]:.2f}x")


def median_share(header: str, key: str) -> Column:
    """The median of `key`, a fraction, as a percentage with one decimal."""
    return Column(header, lambda entry: f"{entry['median'][key]:.1%}")


def peak_rss_columns(engines: Mapping[str, dict]) -> list[Column]:
    """The engines' peak memory, in GiB, where the results have it: results from before
    it was recorded keep their tables as they were."""
    if not any("peak_rss" in entry for entry in engines.values()):
        return []
    return [Column("peak RSS (GiB)", _peak_cell)]


def _peak_cell(entry: dict) -> str:
    peak = entry.get("peak_rss")
    if peak is None:
        return MISSING
    gib = f"{peak['bytes'] / 2**30:.2f}"
    return f"{gib} (the bench's process)" if peak["shared"] else gib


def peak_rss_note(engines: Mapping[str, dict]) -> list[str]:
    """What the peak column measures, under a table that has it; [] otherwise."""
    if not any("peak_rss" in entry for entry in engines.values()):
        return []
    text = (
        "Peak RSS: the engine process's resident high-water mark when the workload ended "
        "(a server's: its processes' added)."
    )
    shared = [name for name, e in engines.items() if e.get("peak_rss", {}).get("shared")]
    if shared:
        text += (
            f" {', '.join(shared)} run in the bench's own process and share its figure, "
            "which counts every model it loaded."
        )
    return ["", text]


def engine_table(engines: Mapping[str, dict], first: str, columns: Sequence[Column]) -> list[str]:
    """One row per engine, in the JSON's order: its name under `first`, then the columns."""
    header = [first, *(column.header for column in columns)]
    rows = [[name, *(column.cell(entry) for column in columns)] for name, entry in engines.items()]
    return markdown_table(header, rows)
