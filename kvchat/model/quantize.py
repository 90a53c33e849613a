"""`--quantize int8|int4` for Hugging Face folders: weight-only round-to-nearest at load.

Group-wise (32 columns) asymmetric int4 or per-channel int8 of every projection
matrix; embeddings and norms stay in the compute dtype. int4 in float32 goes to
kvchat's own kernel (`Q4Linear`), torch's being a reference loop there. On devices without the
int kernels (CUDA), the weights are left dense: correct, just not smaller.
"""

from __future__ import annotations

import torch

from kvchat.model.config import ModelConfig
from kvchat.model.linear import Linear
from kvchat.model.quantized_linear import (
    Int4Linear,
    Int8Linear,
    Q4Linear,
    int4_supported,
    quantize_int4_rtn,
)

_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj.weight": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj.weight": ("mlp.down_proj",),
}


def quantize_weights(
    tensors: dict[str, torch.Tensor],
    config: ModelConfig,
    mode: str,
    dtype: torch.dtype,
    device: torch.device,
) -> dict[str, Linear]:
    if device.type != "cpu":
        return {}
    out: dict[str, Linear] = {}
    for i in range(config.num_layers):
        prefix = f"model.layers.{i}."
        for target, parts in _FUSED.items():
            if target.startswith("mlp.") and config.layer_is_sparse(i):
                continue  # experts stay in the compute dtype
            if target.startswith("self_attn.") and config.layer_is_linear(i):
                continue  # a hybrid model's linear-attention layers stay dense too
            weight = torch.cat([tensors[f"{prefix}{p}.weight"] for p in parts])
            biases = [tensors.get(f"{prefix}{p}.bias") for p in parts]
            bias = torch.cat(biases) if all(b is not None for b in biases) else None
            if mode == "int8":
                out[prefix + target] = Int8Linear(weight, dtype, bias=bias, dense=weight)
            elif dtype == torch.float32 and device.type == "cpu" and weight.shape[1] % 32 == 0:
                # kvchat's kernel: torch's int4 kernel runs a reference loop in float32
                codes, scales, offsets = quantize_int4_rtn(weight)
                out[prefix + target] = Q4Linear(codes, scales, offsets, bias=bias)
            elif int4_supported(device, weight.shape[1], weight.shape[0]):
                codes, scales, offsets = quantize_int4_rtn(weight)
                out[prefix + target] = Int4Linear(
                    codes, scales, offsets, dtype, bias=bias, dense=weight
                )
    return out
