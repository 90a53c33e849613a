"""Per-call time of a 4-bit layer's product, kvchat's kernel beside torch's.

For each weight shape (N x K) and row count: kvchat's `q4_matmul` with float32 and with
bf16 activations, its `q8_matmul` on 6-bit codes with a scale per 16 (a GGUF's Q6_K)
likewise, torch's int4 kernel with bf16 and with float32 activations, and a dense
float32 product with the dequantized weight (the float32 matrix-product rate). Median
of repeated calls, after a warm-up. Run it natively and with an emulated AVX2 CPU:

    python benchmarks/quantized_matmul.py
    KVCHAT_KERNEL_ARCH=x86-64-v3 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 \\
        MKL_ENABLE_INSTRUCTIONS=AVX2 python benchmarks/quantized_matmul.py

Prints a markdown table (microseconds per call) and the CPU it ran on.
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

from kvchat.model.quantized_linear import (
    GROUP_SIZE,
    INNER_K_TILES,
    Q4Linear,
    quantize_int4_rtn,
)
from kvchat.native import build as native_build

SHAPES = [(1536, 576), (8192, 2048), (2048, 8192)]
ROWS = [1, 2, 4, 8, 16, 24, 32, 64, 128, 512]


def cpu_name() -> str:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return "unknown CPU"
    names = [ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")]
    return names[0] if names else "unknown CPU"


def median_us(fn, budget_s: float = 0.4) -> float:
    fn()
    times: list[float] = []
    spent = 0.0
    while spent < budget_s or len(times) < 3:
        start = time.perf_counter()
        fn()
        took = time.perf_counter() - start
        times.append(took)
        spent += took
        if len(times) >= 200:
            break
    times.sort()
    return times[len(times) // 2] * 1e6


def measure(n: int, k: int, rows: int, slow_reference: bool) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(n, k, generator=g) * 0.02
    codes, scales, offsets = quantize_int4_rtn(w)
    layer = Q4Linear(codes, scales, offsets)
    dense = layer.dequantized()
    x = torch.randn(rows, k, generator=g)
    packed = torch._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), INNER_K_TILES)
    zeros = offsets + 8.0 * scales
    sz32 = torch.stack([scales.t(), zeros.t()], dim=-1).contiguous()
    sz16 = sz32.bfloat16()
    xb = x.bfloat16()
    six_bit = torch.randint(-32, 32, (n, k), generator=g, dtype=torch.int8).view(torch.uint8)
    per_16 = (torch.rand(n, k // 16, generator=g) * 0.01).half()
    out = {
        "kvchat q4, float32": median_us(
            lambda: torch.ops.kvchat.q4_matmul(x, layer.codes, layer.scales, layer.offsets)
        ),
        "kvchat q4, bf16": median_us(
            lambda: torch.ops.kvchat.q4_matmul(xb, layer.codes, layer.scales, layer.offsets)
        ),
        "kvchat q6, float32": median_us(
            lambda: torch.ops.kvchat.q8_matmul(x, six_bit, per_16, small_codes=True)
        ),
        "kvchat q6, bf16": median_us(
            lambda: torch.ops.kvchat.q8_matmul(xb, six_bit, per_16, small_codes=True)
        ),
        "torch int4, bf16": median_us(
            lambda: torch._weight_int4pack_mm_for_cpu(xb, packed, GROUP_SIZE, sz16)
        ),
        "dense float32": median_us(lambda: torch.mm(x, dense.t())),
    }
    if slow_reference:
        out["torch int4, float32"] = median_us(
            lambda: torch._weight_int4pack_mm_for_cpu(x, packed, GROUP_SIZE, sz32), 0.1
        )
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="*", default=ROWS)
    args = parser.parse_args()
    native_build.request(wait=True)
    if not native_build.loaded():
        raise SystemExit(f"kvchat's kernels are not loaded: {native_build.status().detail}")
    print(f"CPU: {cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}")
    print(
        f"kernel: {torch.ops.kvchat.quantized_matmul_isa()}, "
        f"oneDNN ISA cap: {os.environ.get('ONEDNN_MAX_CPU_ISA', 'none')}, "
        f"ATen capability: {torch.backends.cpu.get_cpu_capability()}"
    )
    for n, k in SHAPES:
        print(f"\n{n}x{k} (N x K), microseconds per call\n")
        header = None
        for rows in args.rows:
            result = measure(n, k, rows, slow_reference=rows == 1)
            if header is None:
                header = list(result)
                print("| rows | " + " | ".join(header) + " |")
                print("|---" * (len(header) + 1) + "|")
            cells = [f"{result[h]:,.0f}" if h in result else "" for h in header]
            print(f"| {rows} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
