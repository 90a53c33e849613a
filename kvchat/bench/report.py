"""The bench's outputs: a Markdown table, the JSON of every number, and PNG charts.

The Markdown is what the README shows (medians, engines side by side, the
machine line on top); the JSON keeps every run's raw numbers so anyone can
recompute it; the charts show TTFT per turn on W1 and the switch cost against
history length. matplotlib is optional: without it the charts are skipped with
a message and everything else is still written.

It stays one module: each workload's section is a small function over the same
JSON with the same table helpers, listed in `SECTIONS` in the order the report
prints them, so a reader finds any table's code by its heading.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

from kvchat.bench.machine import machine_line
from kvchat.bench.targets import check_targets
from kvchat.units import format_size

JSON_NAME = "bench.json"
MARKDOWN_NAME = "bench.md"
W1_CHART = "w1_ttft.png"
SWEEP_CHART = "sweep_ttft.png"


def _f(value: object, digits: int = 2) -> str:
    if value is None:
        return "—"
    if isinstance(value, float):
        if abs(value) >= 100:
            return f"{value:,.0f}"
        return f"{value:.{digits}f}"
    if isinstance(value, int):
        return f"{value:,}"
    return str(value)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return lines


def _leftovers(w: dict) -> list[str]:
    na = w.get("not_applicable", {})
    lines = [f"- {name}: not applicable ({why})" for name, why in na.items()]
    lines += [f"- {name}: failed ({why})" for name, why in w.get("errors", {}).items()]
    return lines


def _speed(w: dict) -> list[str]:
    lengths = [str(n) for n in w.get("prompt_lengths", [])]
    header = [
        "engine",
        *(f"prefill {n} (tok/s)" for n in lengths),
        "decode, batch 1 (tok/s)",
        "decode from a short prompt (tok/s)",
        "share of the bandwidth bound",
    ]
    rows = []
    for name, e in w["engines"].items():
        m = e["median"]
        rows.append(
            [
                name,
                *(_f(m["prefill_tok_s"].get(n)) for n in lengths),
                _f(m["decode_tok_s"], 1),
                _f(m.get("short_decode_tok_s"), 1),
                f"{e['bandwidth_fraction']:.0%}",
            ]
        )
    bw = w["memory_bandwidth_gbs"]["median"]
    decode = w.get("decode", {})
    return [
        "## Speed",
        "",
        *_table(header, rows),
        "",
        f"Prefill: logits of the last token only. Decode: {decode.get('tokens')} tokens after a "
        f"{decode.get('prompt')}-token prompt, and after a {decode.get('short_prompt')}-token "
        "one (llama-bench's tg figures start from an empty context). Memory read bandwidth "
        f"(torch): {bw:.1f} GB/s; "
        f"{format_size(w['weight_bytes_per_token'])} of weights per token, so decode is bound "
        f"near {w['decode_bound_tok_s']:.0f} tok/s (llama.cpp streams its own quantized file).",
    ]


def _w1(w: dict) -> list[str]:
    header = [
        "engine",
        "total (s)",
        "vs kvchat",
        "TTFT, first turn (s)",
        "TTFT, follow-up (s)",
        "slowest follow-up (s)",
        "prefilled tokens",
        "follow-up prefill beyond new tokens",
    ]
    rows = []
    for name, e in w["engines"].items():
        m = e["median"]
        rows.append(
            [
                name,
                _f(m["total_s"], 1),
                f"{e.get('total_vs_kvchat', 1.0):.2f}x",
                _f(m["ttft_first_turn_s"]),
                _f(m["ttft_follow_up_s"], 3),
                _f(m["ttft_follow_up_max_s"], 3),
                _f(m["prefilled_tokens"]),
                _f(m["follow_up_excess_prefill"]),
            ]
        )
    docs = w.get("documents", {})
    lines = [
        f"## W1: 4 sessions, {_f(docs.get('tokens_each'))}-token documents, "
        f"{w.get('rounds')} rounds of follow-ups, {w.get('answer_tokens')}-token answers",
        "",
        *_table(header, rows),
    ]
    ours = w["engines"].get("kvchat")
    if ours:
        turns = ours["runs"][0]["turns"]
        per_turn = ", ".join(f"{t['prefilled_tokens']} ({t['new_tokens']} new)" for t in turns)
        lines += ["", f"kvchat prefilled tokens per turn (first run): {per_turn}."]
    return lines


def _sweep(w: dict) -> list[str]:
    lengths = w.get("lengths", [])
    header = ["engine", *(f"{n:,} tokens" for n in lengths)]
    rows = [[name, *(_f(v, 3) for v in e["median"]["ttft_s"])] for name, e in w["engines"].items()]
    return [
        "## Switch cost against history length",
        "",
        "TTFT (s) of a follow-up in conversation A after a turn in conversation B.",
        "",
        *_table(header, rows),
    ]


def _w2(w: dict) -> list[str]:
    header = ["engine", "aggregate decode (tok/s)", "wall, prefill included (tok/s)", "wall (s)"]
    rows = [
        [
            name,
            _f(e["median"]["decode_tok_s"], 1),
            _f(e["median"]["wall_tok_s"], 1),
            _f(e["median"]["wall_s"]),
        ]
        for name, e in w["engines"].items()
    ]
    return [
        f"## W2: {w.get('sessions')} sessions generating {w.get('tokens_each')} tokens at once",
        "",
        *_table(header, rows),
    ]


def _w3(w: dict) -> list[str]:
    header = [
        "engine",
        "ITL p50 alone (ms)",
        "ITL p99 alone (ms)",
        "ITL p50 during ingest (ms)",
        "ITL p99 during ingest (ms)",
        "p99 ratio",
        "ingest (s)",
    ]
    rows = []
    for name, e in w["engines"].items():
        m = e["median"]
        rows.append(
            [
                name,
                *(
                    _f(m[k] * 1000, 1)
                    for k in (
                        "itl_p50_alone_s",
                        "itl_p99_alone_s",
                        "itl_p50_ingest_s",
                        "itl_p99_ingest_s",
                    )
                ),
                f"{m['p99_ratio']:.2f}x",
                _f(m["ingest_s"]),
            ]
        )
    ingest = next(iter(w["engines"].values()), {}).get("median", {}).get("ingest_tokens")
    return [
        f"## W3: {w.get('streams')} streams while one session ingests a {_f(ingest)}-token prompt",
        "",
        *_table(header, rows),
    ]


def _w4(w: dict) -> list[str]:
    header = [
        "device cache",
        "device pages",
        "host pages",
        "hit rate",
        "total (s)",
        "TTFT, follow-up (s)",
        "from host (tokens)",
        "prefilled",
        "evictions d→h / h✗ / d✗",
    ]
    rows = []
    for name, e in w["engines"].items():
        m = e["median"]
        ev = m["evictions"]
        rows.append(
            [
                name,
                _f(m["device_pages"]),
                _f(m["host_pages"]),
                f"{m['hit_rate']:.1%}",
                _f(m["total_s"], 1),
                _f(m["ttft_follow_up_s"], 3),
                _f(m["cached_host_tokens"]),
                _f(m["prefilled_tokens"]),
                f"{_f(ev['device_to_host'])} / {_f(ev['host_dropped'])} / "
                f"{_f(ev['device_dropped'])}",
            ]
        )
    return [
        f"## W4: W1 with the device cache at half its working set "
        f"({_f(w.get('working_set_pages'))} pages of {w.get('page_size')} tokens)",
        "",
        *_table(header, rows),
    ]


def _w7(w: dict) -> list[str]:
    header = ["mode", "TTFT, first turn (s)", "slowest (s)", "prefilled", "from drafts"]
    rows = []
    for name, e in w["engines"].items():
        m = e["median"]
        rows.append(
            [
                name,
                _f(m["ttft_first_turn_s"], 3),
                _f(max(m["ttft_per_session_s"]), 3),
                _f(m["prefilled_tokens"]),
                _f(m["draft_tokens"]),
            ]
        )
    lines = [
        f"## W7: paste then ask ({w.get('sessions')} sessions, a "
        f"{_f(w.get('document_tokens'))}-token document drafted, then a question sent)",
        "",
        *_table(header, rows),
        "",
        "Replies identical with and without drafts: "
        + ("yes" if w.get("replies_identical") else "no"),
    ]
    for name, e in w.get("interference", {}).get("engines", {}).items():
        m = e["median"]
        lines += [
            "",
            *_table(
                [
                    "interference",
                    "ITL p99 alone (ms)",
                    "ITL p99 while drafting (ms)",
                    "p99 ratio",
                    "draft ready (tokens)",
                ],
                [
                    [
                        name,
                        _f(m["itl_p99_alone_s"] * 1000, 1),
                        _f(m["itl_p99_drafting_s"] * 1000, 1),
                        f"{m['p99_ratio']:.2f}x",
                        f"{_f(m['draft_ready_tokens'])} of {_f(m['draft_tokens'])}",
                    ]
                ],
            ),
        ]
    return lines


def _w5(w: dict) -> list[str]:
    header = [
        "engine",
        "TTFT, follow-up after restart (s)",
        "slowest (s)",
        "vs recompute",
        "from disk (tokens)",
        "prefilled (tokens)",
        "page cache",
        "replies as recompute",
    ]
    rows = []
    for name, e in w["engines"].items():
        m = e["median"]
        ratio = e.get("ttft_vs_recompute")
        rows.append(
            [
                name,
                _f(m["ttft_follow_up_s"], 3),
                _f(m["ttft_follow_up_max_s"], 3),
                "—" if ratio is None else f"{ratio:.3f}",
                _f(m["cached_disk_follow_up_tokens"]),
                _f(m["prefilled_follow_up_tokens"]),
                str(m["page_cache"]),
                e.get("replies_same_as_recompute", "—"),
            ]
        )
    doc = w.get("documents", {})
    return [
        f"## W5: restart with {len(doc.get('files', []))} conversations of "
        f"{_f(doc.get('tokens_each'))} tokens",
        "",
        "kvchat quits cleanly, then a new kvchat process opens the same database and "
        "disk-tier folder (the page cache dropped between the two processes for the cold "
        "row) and asks one follow-up per conversation; TTFT from the follow-up's start to "
        "its first token, the new process's model load not in it, as the peers' figures "
        "hold no model load either (transformers' restart stays in the bench's process, "
        "its `torch.load` in the TTFT).",
        "",
        *_table(header, rows),
    ]


def _w6(w: dict) -> list[str]:
    header = [
        "configuration",
        "total (s)",
        "TTFT follow-up median (s)",
        "p95 (s)",
        "hit rate",
        "from disk (tokens)",
        "prefilled, follow-ups",
    ]
    rows = [
        [
            name,
            _f(e["median"]["total_s"], 1),
            _f(e["median"]["ttft_follow_up_s"], 3),
            _f(e["median"]["ttft_follow_up_p95_s"], 3),
            f"{e['median']['hit_rate']:.1%}",
            _f(e["median"]["cached_tokens"]["disk"]),
            _f(e["median"]["prefilled_follow_up_tokens"]),
        ]
        for name, e in w["engines"].items()
    ]
    doc = w.get("documents", {})
    return [
        f"## W6: {w.get('sessions')} conversations of {_f(doc.get('tokens_each'))} tokens, "
        f"{w.get('rounds')} rounds, device cache {_f(w.get('device_cache_bytes', 0) / 2**20, 0)} "
        f"MiB, host {_f(w.get('host_cache_bytes', 0) / 2**20, 0)} MiB",
        "",
        *_table(header, rows),
    ]


SECTIONS: dict[str, Callable[[dict], list[str]]] = {
    "speed": _speed,
    "W1": _w1,
    "sweep": _sweep,
    "W2": _w2,
    "W3": _w3,
    "W4": _w4,
    "W5": _w5,
    "W6": _w6,
    "W7": _w7,
}


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
    for name, section in SECTIONS.items():
        w = results["workloads"].get(name)
        if w is None:
            continue
        lines.append("")
        if w["engines"]:
            lines += section(w)
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
                _f(b["value"], 3),
                ("≥ " if b["higher_is_better"] else "≤ ") + _f(b["target"], 3),
                "yes" if b["passed"] else "**no**",
            ]
            for b in targets
        ]
        lines += [
            "",
            "## Targets (ratios within this run)",
            "",
            *_table(["workload", "claim", "value", "target", "met"], rows),
        ]
    charts = results.get("charts", {})
    if charts:
        lines += ["", *(f"![{name}]({path})" for name, path in charts.items())]
    return "\n".join(lines) + "\n"


def plot_w1(results: dict, path: Path) -> str | None:
    """TTFT per turn per engine on W1; returns why it was skipped, or None."""
    w = results["workloads"].get("W1")
    if not w or not w["engines"]:
        return "no W1 numbers to plot"
    plt = _pyplot()
    if plt is None:
        return "matplotlib is not installed (pip install 'kvchat[bench]')"
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, e in w["engines"].items():
        ttft = e["median"]["ttft_per_turn_s"]
        ax.plot(range(1, len(ttft) + 1), ttft, marker="o", label=name)
    ax.set_yscale("log")
    ax.set_xlabel("turn (4 documents, then follow-ups round robin)")
    ax.set_ylabel("time to first token (s)")
    ax.set_title("W1: TTFT per turn")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def plot_sweep(results: dict, path: Path) -> str | None:
    """Follow-up TTFT after a switch against history length, per engine."""
    w = results["workloads"].get("sweep")
    if not w or not w["engines"]:
        return "no sweep numbers to plot"
    plt = _pyplot()
    if plt is None:
        return "matplotlib is not installed (pip install 'kvchat[bench]')"
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, e in w["engines"].items():
        ax.plot(w["lengths"], e["median"]["ttft_s"], marker="o", label=name)
    ax.set_yscale("log")
    ax.set_xlabel("history length (tokens)")
    ax.set_ylabel("TTFT of a follow-up after a switch (s)")
    ax.set_title("Switch cost against history length")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def write_report(results: dict, out: Path) -> tuple[list[Path], list[str]]:
    """Write the charts, then the JSON and Markdown (which name the charts); (files, notes)."""
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    notes: list[str] = []
    charts: dict[str, str] = {}
    for title, name, plot in (
        ("W1 TTFT per turn", W1_CHART, plot_w1),
        ("switch cost", SWEEP_CHART, plot_sweep),
    ):
        skipped = plot(results, out / name)
        if skipped is None:
            charts[title] = name
            written.append(out / name)
        else:
            notes.append(f"{name} not written: {skipped}")
    results["charts"] = charts
    results["targets"] = [t.to_json() for t in check_targets(results)]
    (out / JSON_NAME).write_text(json.dumps(results, indent=2), encoding="utf-8")
    (out / MARKDOWN_NAME).write_text(markdown(results), encoding="utf-8")
    written += [out / JSON_NAME, out / MARKDOWN_NAME]
    return written, notes
