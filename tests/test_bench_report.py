"""The bench report's Markdown from a results JSON: its number format, its tables, its order.

Rendered from the committed full runs' `bench.json`, so no bench runs here; what is
checked is what a reader of `bench.md` relies on: one section per workload in the
suite's order, one row per engine, figures formatted alike.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from kvchat.bench.report import markdown, write_report
from kvchat.bench.table import Column, engine_table, markdown_table, median_number, number
from kvchat.bench.workloads import WORKLOAD_NAMES, WORKLOADS

RESULTS = sorted(
    (Path(__file__).resolve().parents[1] / "benchmarks" / "results").glob("*/bench.json")
)


@pytest.fixture
def results() -> dict:
    if not RESULTS:
        pytest.skip("no committed bench results")
    return json.loads(RESULTS[0].read_text(encoding="utf-8"))


def test_numbers_print_with_thousands_separators_and_large_floats_without_decimals():
    assert number(12345) == "12,345"
    assert number(1234.6) == "1,235"  # 100 and more: no decimals
    assert number(0.12345, 3) == "0.123"
    assert number(None) == "—"
    assert number("drop_caches") == "drop_caches"


def test_an_engine_table_has_one_row_per_engine_in_the_jsons_order():
    engines = {"b": {"median": {"t": 1.5}}, "a": {"median": {"t": 2.26}}}
    lines = engine_table(engines, "engine", [median_number("t (s)", "t", 1)])
    assert lines == markdown_table(["engine", "t (s)"], [["b", "1.5"], ["a", "2.3"]])
    assert lines[1] == "|---|---|"
    with_entry = [Column("vs b", lambda e: f"{e['median']['t'] / 1.5:.2f}x")]
    assert engine_table(engines, "engine", with_entry)[-1] == "| a | 1.51x |"


def test_the_registry_lists_every_workload_once_in_the_suites_order():
    assert WORKLOAD_NAMES == ("speed", "W1", "sweep", "W2", "W3", "W4", "W5", "W6", "W7")
    assert all(w.name == name for name, w in WORKLOADS.items())
    charts = [w.chart.file_name for w in WORKLOADS.values() if w.chart]
    assert charts == ["w1_ttft.png", "sweep_ttft.png"]


def test_the_report_has_a_section_per_workload_run_in_the_suites_order(results):
    text = markdown(copy.deepcopy(results))
    headings = [line for line in text.splitlines() if line.startswith("## ")]
    run = [name for name in WORKLOAD_NAMES if name in results["workloads"]]
    assert len(headings) == len(run) + (1 if results.get("targets") else 0)
    assert headings[0] == "## Speed" and headings[1].startswith("## W1: ")
    for name in run:
        for engine in results["workloads"][name]["engines"]:
            assert f"| {engine} |" in text, (name, engine)


def test_a_workload_without_numbers_says_so_and_keeps_its_reasons(results):
    results = copy.deepcopy(results)
    w3 = results["workloads"]["W3"]
    w3["engines"] = {}
    w3["errors"] = {"kvchat": "RuntimeError: out of pages"}
    text = markdown(results)
    assert "## W3: no engine produced numbers" in text
    assert "- kvchat: failed (RuntimeError: out of pages)" in text


def test_write_report_names_each_chart_or_why_it_was_not_written(results, tmp_path):
    results = copy.deepcopy(results)
    del results["workloads"]["sweep"]
    written, notes = write_report(results, tmp_path)
    assert "sweep_ttft.png not written: no sweep numbers to plot" in notes
    assert {p.name for p in written} >= {"bench.json", "bench.md"}
    saved = json.loads((tmp_path / "bench.json").read_text(encoding="utf-8"))
    assert saved["targets"] and "sweep_ttft.png" not in saved["charts"].values()
