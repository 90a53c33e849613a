"""Perplexity of the default model on a fixed 2,000-token text, per weight and KV format.

The text is the start of the Python documentation shipped with the interpreter
(`pydoc_data/topics.py`), so anyone can reproduce it. Tokens are fed in chunks of
256 through the paged attention, so every chunk reads the earlier tokens' K/V from
the cache in the format under test.

    python benchmarks/quality.py            # prints a Markdown table
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvchat.engine.attention.paged_attention import PagedAttention
from kvchat.engine.tiers.kv_store import DeviceKVStore
from kvchat.model.batch import ForwardBatch
from kvchat.model.loader import load_model
from kvchat.native import build

N_TOKENS = 2000
CHUNK = 256


def evaluation_text() -> str:
    import pydoc_data.topics as topics

    return "\n\n".join(topics.topics[k] for k in sorted(topics.topics))


def perplexity(model, ids: list[int], kv_format: str) -> float:
    c = model.config
    page = 256
    pages = len(ids) // page + 2
    store = DeviceKVStore(
        c.num_layers,
        pages,
        page,
        c.num_kv_heads,
        c.head_dim,
        model.transformer.dtype,
        "cpu",
        kv_format,
    )
    attention = PagedAttention.for_store(store)
    nll, count = 0.0, 0
    for start in range(0, len(ids) - 1, CHUNK):
        run = ids[start : start + CHUNK]
        batch = ForwardBatch.from_runs([run], [start], all_logits=True)
        attention.prepare(batch, [list(range(pages))])
        logits = model.transformer.forward(batch, attention)  # [n, vocab] float32
        targets = torch.tensor(ids[start + 1 : start + 1 + len(run)])
        logits = logits[: len(targets)]
        nll += float(torch.nn.functional.cross_entropy(logits, targets, reduction="sum"))
        count += len(targets)
    return math.exp(nll / count)


def main() -> None:
    build.request(wait=True)  # the small ops and attention users get once the kernels load
    print(f"kvchat's kernels: {build.status().detail}\n")
    rows = []
    for weights in ("bf16", "native"):
        model = load_model(None, dtype="bfloat16", weights=weights)
        ids = model.tokenizer.encode(evaluation_text())[:N_TOKENS]
        for kv in ("native", "int8"):
            rows.append((weights, kv, perplexity(model, ids, kv)))
    base = rows[0][2]
    print("| weights | KV | perplexity | vs dequantized bf16 + bf16 KV |")
    print("|---|---|---|---|")
    for weights, kv, ppl in rows:
        label = {"bf16": "dequantized bf16", "native": "GGUF 4-bit (int4 kernel)"}[weights]
        kv_label = {"native": "bf16", "int8": "int8"}[kv]
        print(f"| {label} | {kv_label} | {ppl:.3f} | {100 * (ppl / base - 1):+.2f}% |")


if __name__ == "__main__":
    main()
