"""The bench's outputs: a Markdown table, the JSON of every number, and PNG charts.

The Markdown is what the README shows (medians, engines side by side, the
machine line on top); the JSON keeps every run's raw numbers so anyone can
recompute it; the charts show TTFT per turn on W1 and the switch cost against
history length. matplotlib is optional: without it the charts are skipped with
a message and everything else is still written.

Each workload's table and chart live in that workload's module (`workloads/`); this
module puts them together in the registry's order, under the machine line, and adds
the targets.
"""

from __future__ import annotations

import json
from pathlib import Path

from kvchat.bench.machine import machine_line
from kvchat.bench.table import markdown_table, number
from kvchat.bench.targets import check_targets
from kvchat.bench.workloads import WORKLOADS
from kvchat.bench.workloads.workload import Chart

JSON_NAME = "bench.json"
MARKDOWN_NAME = "bench.md"


def _leftovers(w: dict) -> list[str]:
    na = w.get("not_applicable", {})
    lines = [f"- {name}: not applicable ({why})" for name, why in na.items()]
    lines += [f"- {name}: failed ({why})" for name, why in w.get("errors", {}).items()]
    return lines


def _revision(results: dict) -> str:
    """'0.1.0, commit abc1234 (with local changes)', or what is known of it."""
    info = results.get("kvchat")
    if not info:
        return "version and commit not recorded"
    git = info.get("git")
    if not git:
        return f"{info['version']}, not run from a git checkout"
    dirty = " (with local changes)" if git["dirty"] else ""
    return f"{info['version']}, commit {git['commit'][:12]}{dirty}"


def markdown(results: dict) -> str:
    """The report as Markdown: the machine, the engines, one table per workload, the targets."""
    info = results["machine"]
    model = results["model"]
    lines = [
        "# kvchat bench",
        "",
        f"- Machine: {machine_line(info)}",
        f"- Model: {model['name']} ({model['dtype']}), KV pages of {model['page_size']} tokens",
        f"- kvchat: {_revision(results)}",
        f"- Run: {'quick (reduced sizes: not representative)' if results['quick'] else 'full'}, "
        f"{results['repeats']} repeat(s), medians; `{results['command']}`",
    ]
    lines += [f"- Note: {n}" for n in results.get("notes", [])]
    lines += ["", "Engines:", ""]
    lines += [f"- **{name}**: {desc}" for name, desc in results["engines"].items()]
    lines += [f"- {name}: skipped ({why})" for name, why in results["skipped"].items()]
    for name, workload in WORKLOADS.items():
        w = results["workloads"].get(name)
        if w is None:
            continue
        lines.append("")
        if w["engines"]:
            lines += workload.table(w)
        else:
            lines.append(f"## {name}: no engine produced numbers")
        extra = _leftovers(w)
        if extra:
            lines += ["", *extra]
    targets = results.get("targets", [])
    if targets:
        rows = [
            [
                b["workload"],
                b["claim"],
                number(b["value"], 3),
                ("≥ " if b["higher_is_better"] else "≤ ") + number(b["target"], 3),
                "yes" if b["passed"] else "**no**",
            ]
            for b in targets
        ]
        lines += [
            "",
            "## Targets (ratios within this run)",
            "",
            *markdown_table(["workload", "claim", "value", "target", "met"], rows),
        ]
    charts = results.get("charts", {})
    if charts:
        lines += ["", *(f"![{name}]({path})" for name, path in charts.items())]
    return "\n".join(lines) + "\n"


def _write_chart(results: dict, name: str, chart: Chart, path: Path) -> str | None:
    """Write one workload's chart; returns why it was skipped, or None."""
    w = results["workloads"].get(name)
    if not w or not w["engines"]:
        return f"no {name} numbers to plot"
    return chart.plot(w, path)


def write_report(results: dict, out: Path) -> tuple[list[Path], list[str]]:
    """Write the charts, then the JSON and Markdown (which name the charts); (files, notes)."""
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    notes: list[str] = []
    charts: dict[str, str] = {}
    for name, workload in WORKLOADS.items():
        chart = workload.chart
        if chart is None:
            continue
        skipped = _write_chart(results, name, chart, out / chart.file_name)
        if skipped is None:
            charts[chart.title] = chart.file_name
            written.append(out / chart.file_name)
        else:
            notes.append(f"{chart.file_name} not written: {skipped}")
    results["charts"] = charts
    results["targets"] = [t.to_json() for t in check_targets(results)]
    (out / JSON_NAME).write_text(json.dumps(results, indent=2), encoding="utf-8")
    (out / MARKDOWN_NAME).write_text(markdown(results), encoding="utf-8")
    written += [out / JSON_NAME, out / MARKDOWN_NAME]
    return written, notes
