"""Keep a GGUF's quantized matrices quantized: layers built straight from its blocks.

Q4_0, Q4_1 and Q4_K matrices become 4-bit groups of 32 without requantizing (see
`quantized_linear.py`); Q8_0, Q5_0 and Q6_K ones become 8-bit codes with the file's
scales (a scale per 32, or per 16 for Q6_K's sub-blocks), exactly the file's weights:
llama-quantize keeps the head and some matrices in Q6_K even in its 4-bit files (the
tied head is a third of a 1B model's bytes), and a dense copy of those streamed more
bytes a token than all the 4-bit layers together. The q/k rows get llama.cpp's rotary
permutation undone exactly as the dequantizing path does. A fused group (q/k/v,
gate/up) whose parts come in different formats (Q4_K_M's 4-bit q and k beside a Q6_K
v) is a `StackedLinear`, each part in its own format; a group with a part of any other
type stays dense. Qwen3-MoE's, Qwen3-Next's and Qwen3.5-MoE's experts, stacked in one
4-bit tensor per projection, become a 4-bit gate/up and down per expert
(`expert_linears`), so a 4-bit MoE file stays 4-bit in memory.

Every layer goes to kvchat's own kernels (`Q4Linear`, `Q8Linear`), which compute the
file's exact weights. In float32 (CPUs without native bf16), where torch's int kernels
run a reference loop, they take every row count (prefill included) and no dense copy is
kept. In bf16 they take decode rows, widened to float32, and a dense bf16 copy takes
prefill batches: a decode step of a 1B model's Q4_0 file took 58 ms against 62 with
torch's int4 kernel (scales and zeros in bf16), and the 8-bit kernel beats torch's
int8 one (docs/kernels.md).
"""

from __future__ import annotations

import torch

from kvchat.model.config import ModelConfig
from kvchat.model.gguf.convert import PERMUTED_ARCHITECTURES, undo_llama_cpp_permute
from kvchat.model.gguf.dequant import (
    EIGHT_BIT,
    as_byte_tensor,
    block_size,
    bytes_per_block,
    unpack_int8,
    unpack_q4,
)
from kvchat.model.gguf.file import GGMLType, GGUFFile
from kvchat.model.linear import Linear, StackedLinear
from kvchat.model.quantized_linear import (
    Q4Linear,
    Q8Linear,
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
# Qwen3-Next's and Qwen3.5-MoE's shared expert, gate and up fused as its layer multiplies
# them (the rest of a hybrid's linear-attention layers stays dense: Qwen3.5's files reorder
# their heads)
_SHARED_EXPERT_GROUPS = {
    **_GROUPS,
    "mlp.shared_expert.gate_up_proj": (("ffn_gate_shexp", None), ("ffn_up_shexp", None)),
    "mlp.shared_expert.down_proj.weight": (("ffn_down_shexp", None),),
}


def quantized_linears(
    gguf: GGUFFile,
    config: ModelConfig,
    dtype: torch.dtype,
    dense: dict[str, torch.Tensor] | None,
) -> dict[str, Linear]:
    """HF-named `Linear`s for the 4-bit and 8-bit matrices; `dense` (HF names) gives
    prefill copies and biases. K-quants keep the file's integer sub-scales in bf16, whose
    decode rows are bound by memory; float32's are bound by instructions, and there
    expanding them a row at a time costs more than their bytes save (docs/kernels.md)."""
    compact = dtype != torch.float32
    arch = gguf.metadata.get("general.architecture")
    permute = arch in PERMUTED_ARCHITECTURES
    groups = {
        "phi3": _PHI3_GROUPS,
        "qwen35moe": _SHARED_EXPERT_GROUPS,
        "qwen3next": _SHARED_EXPERT_GROUPS,
    }.get(str(arch), _GROUPS)
    heads = {"q": config.num_heads, "k": config.num_kv_heads}
    hf_parts = {
        "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
        "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
        "mlp.shared_expert.gate_up_proj": (
            "mlp.shared_expert.gate_proj",
            "mlp.shared_expert.up_proj",
        ),
    }
    out: dict[str, Linear] = {}
    for i in range(config.num_layers):
        prefix = f"model.layers.{i}."
        for target, parts in groups.items():
            infos = [gguf.tensors.get(f"blk.{i}.{name}.weight") for name, _ in parts]
            if any(info is None or info.ggml_type not in KEPT for info in infos):
                continue
            blocks = []
            for (_, kind), info in zip(parts, infos, strict=True):
                form, b = _unpack(gguf, info, compact)
                if permute and kind in heads:
                    b = tuple(undo_llama_cpp_permute(t, heads[kind]) for t in b)
                blocks.append((form, b))
            names = [
                f"{prefix}{p}.weight"
                for p in hf_parts.get(target, (target.removesuffix(".weight"),))
            ]
            # a part per HF name, except Phi-3's files, whose one part holds them all
            per_part = [[n] for n in names] if len(parts) == len(names) else [names]
            runs = _runs(blocks, per_part)
            linears = [_run_linear(run, dense, dtype) for run in runs]
            out[prefix + target] = linears[0] if len(linears) == 1 else StackedLinear(linears)
    if arch in ("qwen3moe", "qwen35moe", "qwen3next"):
        out.update(expert_linears(gguf, config, dtype))
    head = gguf.tensors.get("output.weight") or gguf.tensors.get("token_embd.weight")
    if head is not None and head.ggml_type in EIGHT_BIT:
        # the file's exact weights at 8 bits: a Q6_K head (llama-quantize's choice for
        # Q4_0 and Q4_K_M files) is the largest matrix of a small model
        _, blocks = _unpack(gguf, head, compact)
        out["lm_head"] = Q8Linear(*blocks)
    return out


KEPT = (*FOUR_BIT, *EIGHT_BIT)
"""Types whose matrices stay quantized: the rest are dequantized to the compute dtype."""


def _unpack(gguf: GGUFFile, info, compact: bool) -> tuple[tuple, tuple[torch.Tensor, ...]]:
    """(form, blocks): a 4-bit matrix's (codes, scales, offsets) or an 8-bit one's
    (codes, scales), K-quants' with their super-scales after (their file's bytes) when
    `compact`; the form tells which parts fuse into one matrix (same layer class, same
    tensors)."""
    if info.ggml_type in FOUR_BIT:
        b = unpack_q4(gguf.raw(info.name), info.ggml_type, info.shape, compact=compact)
        supers = () if b.scale_supers is None else (b.scale_supers, b.offset_supers)
        return (4, len(supers)), (b.codes, b.scales, b.offsets, *supers)
    b8 = unpack_int8(gguf.raw(info.name), info.ggml_type, info.shape, compact=compact)
    supers = () if b8.scale_supers is None else (b8.scale_supers,)
    return (8, b8.group, len(supers)), (b8.codes, b8.scales, *supers)


def _runs(blocks: list[tuple], names: list[list[str]]) -> list[tuple[list[tuple], list[str]]]:
    """Consecutive parts of one form fused into one matrix each, with their HF names."""
    runs: list[tuple[list[tuple], list[str]]] = []
    last = None
    for (form, b), part_names in zip(blocks, names, strict=True):
        if form != last:
            runs.append(([], []))
            last = form
        runs[-1][0].append(b)
        runs[-1][1].extend(part_names)
    return runs


def _run_linear(run: tuple[list[tuple], list[str]], dense, dtype: torch.dtype) -> Linear:
    """One fused run's layer, multiplied by kvchat's kernels: in float32 at every row count
    (no dense copy), in bf16 for decode rows, with a dense copy for prefill batches."""
    blocks, names = run
    bias_names = [n.replace(".weight", ".bias") for n in names]
    bias = None
    if dense is not None and all(b in dense for b in bias_names):
        bias = torch.cat([dense[b] for b in bias_names])
    dense_copy = None
    if dtype != torch.float32 and dense is not None and all(n in dense for n in names):
        dense_copy = torch.cat([dense[n] for n in names]) if len(names) > 1 else dense[names[0]]
    if blocks[0][0].dtype == torch.int8:
        return Q8Linear.fused(blocks, bias=bias, dense=dense_copy)
    return Q4Linear.fused(blocks, bias=bias, dense=dense_copy)


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
        raw = [as_byte_tensor(gguf.raw(info.name)) for info in infos]
        for e in range(config.num_experts):
            blocks = []
            for info, data in zip(infos, raw, strict=True):
                _, rows, cols = info.shape
                size = rows * cols // block_size(info.ggml_type) * bytes_per_block(info.ggml_type)
                b = unpack_q4(data[e * size : (e + 1) * size], info.ggml_type, (rows, cols))
                blocks.append((b.codes, b.scales, b.offsets))
            prefix = f"model.layers.{i}.mlp.experts.{e}."
            out[prefix + "gate_up_proj"] = Q4Linear.fused(blocks[:2])
            out[prefix + "down_proj"] = Q4Linear.fused(blocks[2:])
    return out
