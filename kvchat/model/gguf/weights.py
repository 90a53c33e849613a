"""Keep a GGUF's 4-bit matrices 4-bit: build `Int4Linear`s straight from its blocks.

Q4_0, Q4_1 and Q4_K matrices become int4 groups of 32 without requantizing (see
`quantized_linear.py`); the q/k rows get llama.cpp's rotary permutation undone
exactly as the dequantizing path does. A fused group (q/k/v, gate/up) is kept
4-bit only when all its parts are 4-bit; otherwise it stays dense (correct, and
mixed files such as Q4_K_M keep their higher-precision tensors as they are).
A Q8_0 LM head (or tied embedding) is multiplied through the int8 kernel. Qwen3-MoE's
experts, stacked in one 4-bit tensor per projection, become a 4-bit gate/up and down
per expert (`expert_linears`), so a 4-bit MoE file stays 4-bit in memory.

In float32 (CPUs without native bf16), where torch's int kernels run a reference loop,
the blocks go to kvchat's own kernel as they are (`Q4Linear`, `Q8Linear`): every layer
computes the file's exact weights at every row count (prefill included) and the
weights stay 4-bit in memory, the head 8-bit from its Q8_0 blocks.
"""

from __future__ import annotations

import torch

from kvchat.model.config import ModelConfig
from kvchat.model.gguf.convert import PERMUTED_ARCHITECTURES, undo_llama_cpp_permute
from kvchat.model.gguf.dequant import (
    as_byte_tensor,
    block_size,
    bytes_per_block,
    dequantize,
    unpack_q4,
    unpack_q8_0,
)
from kvchat.model.gguf.file import GGMLType, GGUFFile
from kvchat.model.linear import Linear
from kvchat.model.quantized_linear import (
    Int4Linear,
    Int8Linear,
    Q4Linear,
    Q8Linear,
    int4_supported,
)

FOUR_BIT = (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q4_K)

_GROUPS = {
    "self_attn.qkv_proj": (("attn_q", "q"), ("attn_k", "k"), ("attn_v", "v")),
    "self_attn.o_proj.weight": (("attn_output", None),),
    "mlp.gate_up_proj": (("ffn_gate", None), ("ffn_up", None)),
    "mlp.down_proj.weight": (("ffn_down", None),),
}
# Phi-3's files hold q/k/v and gate/up fused already, in kvchat's order
_PHI3_GROUPS = {
    **_GROUPS,
    "self_attn.qkv_proj": (("attn_qkv", None),),
    "mlp.gate_up_proj": (("ffn_up", None),),
}


def quantized_linears(
    gguf: GGUFFile,
    config: ModelConfig,
    dtype: torch.dtype,
    dense: dict[str, torch.Tensor] | None,
) -> dict[str, Linear]:
    """HF-named `Linear`s for the 4-bit matrices; `dense` (HF names) gives prefill copies."""
    arch = gguf.metadata.get("general.architecture")
    permute = arch in PERMUTED_ARCHITECTURES
    groups = _PHI3_GROUPS if arch == "phi3" else _GROUPS
    heads = {"q": config.num_heads, "k": config.num_kv_heads}
    hf_parts = {
        "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    }
    out: dict[str, Linear] = {}
    for i in range(config.num_layers):
        for target, parts in groups.items():
            infos = [gguf.tensors.get(f"blk.{i}.{name}.weight") for name, _ in parts]
            if any(info is None or info.ggml_type not in FOUR_BIT for info in infos):
                continue
            rows = sum(info.shape[0] for info in infos)
            # kvchat's float32 kernel takes any GGUF 4-bit matrix; torch's needs N % 16
            if dtype != torch.float32 and not int4_supported(
                torch.device("cpu"), infos[0].shape[1], rows
            ):
                continue
            blocks = []
            for (_, kind), info in zip(parts, infos, strict=True):
                b = unpack_q4(gguf.raw(info.name), info.ggml_type, info.shape)
                codes, scales, offsets = b.codes, b.scales, b.offsets
                if permute and kind in heads:
                    n = heads[kind]
                    codes, scales, offsets = (
                        undo_llama_cpp_permute(t, n) for t in (codes, scales, offsets)
                    )
                blocks.append((codes, scales, offsets))
            prefix = f"model.layers.{i}."
            names = [
                f"{prefix}{p}.weight"
                for p in hf_parts.get(target, (target.removesuffix(".weight"),))
            ]
            bias_names = [n.replace(".weight", ".bias") for n in names]
            bias = None
            if dense is not None and all(b in dense for b in bias_names):
                bias = torch.cat([dense[b] for b in bias_names])
            dense_copy = None
            if dense is not None and all(n in dense for n in names):
                dense_copy = (
                    torch.cat([dense[n] for n in names]) if len(names) > 1 else dense[names[0]]
                )
            if dtype == torch.float32:  # the kernel takes prefill too: no dense copy
                out[prefix + target] = Q4Linear.fused(blocks, bias=bias)
            else:
                out[prefix + target] = Int4Linear.fused(blocks, dtype, bias=bias, dense=dense_copy)
    if arch == "qwen3moe":
        out.update(expert_linears(gguf, config, dtype))
    head = gguf.tensors.get("output.weight") or gguf.tensors.get("token_embd.weight")
    if head is not None and head.ggml_type == GGMLType.Q8_0 and head.shape[1] % 32 == 0:
        if dtype == torch.float32:
            # Q8_0's scale a block of 32, exactly: the int8 kernel's one scale a row is
            # a 1.4% logit error on the default model
            blocks8 = unpack_q8_0(gguf.raw(head.name), head.shape)
            out["lm_head"] = Q8Linear(blocks8.codes, blocks8.scales)
        else:
            weight = dequantize(gguf.raw(head.name), head.ggml_type, head.shape)
            out["lm_head"] = Int8Linear(weight, dtype)
    return out


def expert_linears(gguf: GGUFFile, config: ModelConfig, dtype: torch.dtype) -> dict[str, Linear]:
    """Each expert's gate/up and down as 4-bit `Linear`s, named
    `model.layers.{i}.mlp.experts.{e}.gate_up_proj` and `...down_proj`, from a layer's
    stacked expert tensors ([E, rows, columns], expert-major bytes) where all three are
    4-bit; no dense copies (an expert multiplies few rows a step)."""
    out: dict[str, Linear] = {}
    for i in range(config.num_layers):
        infos = [gguf.tensors.get(f"blk.{i}.ffn_{p}_exps.weight") for p in ("gate", "up", "down")]
        if any(info is None or info.ggml_type not in FOUR_BIT for info in infos):
            continue
        if dtype != torch.float32 and not all(
            int4_supported(torch.device("cpu"), info.shape[2], info.shape[1]) for info in infos
        ):
            continue
        raw = [as_byte_tensor(gguf.raw(info.name)) for info in infos]
        for e in range(config.num_experts):
            blocks = []
            for info, data in zip(infos, raw, strict=True):
                _, rows, cols = info.shape
                size = rows * cols // block_size(info.ggml_type) * bytes_per_block(info.ggml_type)
                b = unpack_q4(data[e * size : (e + 1) * size], info.ggml_type, (rows, cols))
                blocks.append((b.codes, b.scales, b.offsets))
            prefix = f"model.layers.{i}.mlp.experts.{e}."
            if dtype == torch.float32:
                out[prefix + "gate_up_proj"] = Q4Linear.fused(blocks[:2])
                out[prefix + "down_proj"] = Q4Linear.fused(blocks[2:])
            else:
                out[prefix + "gate_up_proj"] = Int4Linear.fused(blocks[:2], dtype)
                out[prefix + "down_proj"] = Int4Linear.fused(blocks[2:], dtype)
    return out
