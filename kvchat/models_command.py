"""`kvchat models`: every model kvchat can name, where it was found, and whether it runs.

One row a model: the name `--model` takes, where it is kept (the default model, a GGUF
converted before, Hugging Face's cache, Ollama, LM Studio, a `model_dirs` folder), its
format, size, quantization and architecture, and "yes" or the reason kvchat cannot run
it, from the checks loading applies (`model_stores.describe`). Nothing is loaded.
"""

from __future__ import annotations

from kvchat.model.model_stores import describe
from kvchat.model.registry import known_models
from kvchat.runtime import read_settings
from kvchat.units import format_size

HEADER = ("name", "source", "format", "size", "quant", "architecture", "runs")


def model_rows(model_dirs: tuple[str, ...] = ()) -> list[tuple[tuple[str, ...], str | None]]:
    """(the row's cells, the reason it does not run or None) for every known model."""
    rows = []
    for m in known_models(model_dirs):
        if not m.available:  # the default model before its first fetch
            rows.append(((m.name, m.kind, "gguf", "", "", "", "yes (fetched on first use)"), None))
            continue
        facts = describe(m.path)
        cells = (
            m.name,
            m.kind,
            facts.format,
            format_size(facts.size) if facts.size else "",
            facts.quantization or "",
            facts.architecture or "",
            "yes" if facts.supported else "no",
        )
        rows.append((cells, facts.reason))
    return rows


def run_models() -> int:
    rows = model_rows(read_settings().model_dirs)
    widths = [max(len(r[i]) for r in [HEADER, *(cells for cells, _ in rows)]) for i in range(7)]
    for cells in (HEADER, *(cells for cells, _ in rows)):
        print("  ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)).rstrip())
    refused = [(cells[0], reason) for cells, reason in rows if reason]
    if refused:
        print()
        for name, reason in refused:
            print(f"{name}: {reason}")
    return 0
