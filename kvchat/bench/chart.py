"""The report's PNG charts: one line per engine on a logarithmic time axis.

matplotlib is optional (the extra `bench`): without it a chart is skipped with the
reason, and the rest of the report is still written.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

NO_MATPLOTLIB = "matplotlib is not installed (pip install 'kvchat[bench]')"


def log_line_chart(
    path: Path,
    lines: Mapping[str, tuple[Sequence[float], Sequence[float]]],
    *,
    xlabel: str,
    ylabel: str,
    title: str,
) -> str | None:
    """Write a chart of `lines` (name -> (x, y)) to `path`; returns why it was skipped, or None."""
    plt = _pyplot()
    if plt is None:
        return NO_MATPLOTLIB
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for name, (x, y) in lines.items():
        ax.plot(x, y, marker="o", label=name)
    ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(title)
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
