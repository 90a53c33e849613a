"""The machine a bench ran on, and its memory ceiling.

A decode step at batch 1 streams every weight once, so its speed is bounded by
memory read bandwidth: bound = bandwidth / weight bytes per token. The bench
measures the bandwidth with torch itself (a large reduction, best of a few) so
the fraction of the bound that each engine reaches is comparable across
machines. The machine line goes at the top of every report.
"""

from __future__ import annotations

import os
import platform
import time

import torch


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine_info(device: torch.device, dtype: torch.dtype) -> dict[str, object]:
    """CPU, cores, torch and the peers' versions: everything the numbers depend on."""
    info: dict[str, object] = {
        "cpu": cpu_model(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "device": device.type,
        "dtype": str(dtype).removeprefix("torch."),
    }
    if device.type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    from kvchat.bench.emulated_cpu import emulated_cpu

    if emulated_cpu():
        info["emulated_cpu"] = emulated_cpu()
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            total_kib = int(f.readline().split()[1])
        info["memory_gib"] = round(total_kib / 2**20, 1)
    except (OSError, ValueError, IndexError):
        pass
    return info


def machine_line(info: dict[str, object]) -> str:
    gpu = f", GPU {info['gpu']}" if "gpu" in info else ""
    mem = f", {info['memory_gib']} GiB" if "memory_gib" in info else ""
    emulated = (
        f" emulating an {str(info['emulated_cpu']).upper()} CPU (`--cpu {info['emulated_cpu']}`)"
        if info.get("emulated_cpu")
        else ""
    )
    return (
        f"{info['cpu']}{emulated}, {info['cores']} cores ({info['torch_threads']} torch "
        f"threads){mem}{gpu}; torch {info['torch']}, Python {info['python']}; "
        f"{info['device']}, {info['dtype']}"
    )


def memory_bandwidth_gbs(nbytes: int, trials: int = 5, device: str = "cpu") -> float:
    """Read bandwidth in GB/s: the best of `trials` sums over a buffer of `nbytes`."""
    x = torch.ones(max(1, nbytes // 4), dtype=torch.float32, device=device)
    x.sum()  # touch it once: first-use costs are not bandwidth
    best = float("inf")
    for _ in range(trials):
        if x.is_cuda:
            torch.cuda.synchronize()
        start = time.perf_counter()
        x.sum()
        if x.is_cuda:
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return x.numel() * 4 / best / 1e9


def weight_bytes_per_token(transformer) -> int:
    """Bytes of weights one decode step reads: every layer, the final norm and the LM head.

    The embedding table is not streamed (one row is read), unless it is also the LM head.
    Weights are plain tensors or `Linear`s (dense or quantized) that report their own bytes.
    """
    parts = [transformer.lm_head, transformer.norm]
    for layer in transformer.layers:
        parts += [getattr(layer, name, None) for name in LAYER_WEIGHTS]
    return sum(_nbytes(p) for p in parts)


LAYER_WEIGHTS = ("input_norm", "post_norm", "qkv", "qkv_bias", "o", "gate_up", "down", "experts")


def _nbytes(weight: object) -> int:
    if weight is None:
        return 0
    if isinstance(weight, torch.Tensor):
        return weight.nbytes
    nbytes = getattr(weight, "nbytes", 0)
    return int(nbytes() if callable(nbytes) else nbytes)


def dense_weight_bytes_per_token(config, dtype: torch.dtype) -> int:
    """What `weight_bytes_per_token` would be with every matrix dense in `dtype`."""
    c = config
    per_layer = (
        c.hidden_size * (c.q_size + 2 * c.kv_size)  # q, k, v
        + c.q_size * c.hidden_size  # o
        + 3 * c.intermediate_size * c.hidden_size  # gate, up, down
        + 2 * c.hidden_size  # the two norms
    )
    params = c.num_layers * per_layer + c.vocab_size * c.hidden_size + c.hidden_size
    return params * torch.empty((), dtype=dtype).element_size()
