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
(`expert_linears`), so a 4-bit MoE file stays 4-bit in memory. The hybrids' Gated
DeltaNet projections (`delta_net_linears`) stay quantized too: q/k/v, z, b and a as one
`in_proj`, out_proj beside, Qwen3.5's value heads put back in the checkpoint's order on
the blocks themselves (rows move whole; out_proj's columns move by scale groups).

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
from kvchat.model.gated_deltanet import split_qwen3_next
from kvchat.model.gguf.convert import (
    HYBRID_ARCHITECTURES,
    PERMUTED_ARCHITECTURES,
    grouped_order,
    undo_llama_cpp_permute,
)
from kvchat.model.gguf.dequant import (
    EIGHT_BIT,
    as_byte_tensor,
    block_size,
    bytes_per_block,
    unpack_int8,
    unpack_q4,
)
from kvchat.model.gguf.file import GGMLType, GGUFFile
from kvchat.model.linear import DenseLinear, Linear, StackedLinear
from kvchat.model.quantized_linear import Q4Linear, Q8Linear, expanded

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
# them (the Gated DeltaNet's projections: `delta_net_linears`)
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
    if arch in HYBRID_ARCHITECTURES and dense is not None:
        out.update(delta_net_linears(gguf, config, dtype, dense))
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
    """`unpacked` for a tensor of the file."""
    return unpacked(gguf.raw(info.name), info.ggml_type, info.shape, compact)


def unpacked(raw, ggml_type: GGMLType, shape, compact: bool) -> tuple[tuple, tuple]:
    """(form, blocks): a 4-bit matrix's (codes, scales, offsets) or an 8-bit one's
    (codes, scales), K-quants' with their super-scales after (their file's bytes) when
    `compact`; the form tells which parts fuse into one matrix (same layer class, same
    tensors)."""
    if ggml_type in FOUR_BIT:
        b = unpack_q4(raw, ggml_type, shape, compact=compact)
        supers = () if b.scale_supers is None else (b.scale_supers, b.offset_supers)
        return (4, len(supers)), (b.codes, b.scales, b.offsets, *supers)
    b8 = unpack_int8(raw, ggml_type, shape, compact=compact)
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
    return kernel_linear(blocks, bias, dense_copy)


def kernel_linear(blocks: list[tuple], bias=None, dense_copy=None) -> Linear:
    """One matrix of parts unpacked alike (`unpacked`), in its kernel's layer."""
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


def delta_net_linears(
    gguf: GGUFFile, config: ModelConfig, dtype: torch.dtype, dense: dict[str, torch.Tensor]
) -> dict[str, Linear]:
    """Each Gated DeltaNet layer's `linear_attn.in_proj` and `linear_attn.out_proj` from
    the file's blocks, where they are 4-bit or 8-bit.

    `in_proj` is the layer's fused q/k/v, z, b and a (`GatedDeltaNet`), built when q/k/v
    (`attn_qkv`) and z (`attn_gate`), the large ones, are quantized; b and a join them
    in the same matrix where the file quantizes them alike, else stay a dense part
    beside (`StackedLinear`). Qwen3.5's files hold the value heads of v, z, b and a
    tiled rather than grouped by key head (`convert.grouped_order`): the rows are taken
    back in the checkpoint's order, exactly, as each row is its own blocks. Qwen3-Next's
    q/k/v and z come in kvchat's order already; its fused `ssm_ba` (b then a per key
    head) is taken as all b, then all a.

    out_proj's value heads are its columns, which a block spans several of: they move
    only by whole scale groups (32 columns, or Q6_K's 16), so a head narrower than a
    group, or not a whole number of groups, leaves it dense. K-quants' 256-column
    super-scales are multiplied into per-group scales first (products exact in
    float32): a head of 128 columns is half a super-block. `dense` (HF names) gives
    bf16's prefill copies, and the dense b and a."""
    shape = config.delta_net
    assert shape is not None  # a hybrid's config has its DeltaNet's shape
    compact = dtype != torch.float32
    arch = gguf.metadata.get("general.architecture")
    reordered = arch != "qwen3next" and shape.num_k_heads != shape.num_v_heads

    def order(head_dim: int) -> torch.Tensor | None:
        return grouped_order(shape.num_k_heads, shape.num_v_heads, head_dim) if reordered else None

    v_rows = order(shape.head_v_dim)
    qkv_rows = None
    if v_rows is not None:
        qkv_rows = torch.cat([torch.arange(2 * shape.key_dim), 2 * shape.key_dim + v_rows])
    if arch == "qwen3next":
        per_k = shape.num_v_heads // shape.num_k_heads
        ba_rows = torch.arange(2 * shape.num_v_heads).view(shape.num_k_heads, 2, per_k)
        # (file tensor, its rows in kvchat's order, the kvchat parts it holds)
        specs = [
            ("attn_qkv", None, ("qkv",)),
            ("attn_gate", None, ("z",)),
            ("ssm_ba", ba_rows.transpose(0, 1).reshape(-1), ("b", "a")),
        ]
    else:
        specs = [
            ("attn_qkv", qkv_rows, ("qkv",)),
            ("attn_gate", v_rows, ("z",)),
            ("ssm_beta", order(1), ("b",)),
            ("ssm_alpha", order(1), ("a",)),
        ]
    out: dict[str, Linear] = {}
    for i in range(config.num_layers):
        if not config.layer_is_linear(i):
            continue
        prefix = f"model.layers.{i}.linear_attn."
        parts = _delta_net_dense(config, dense, prefix)
        in_proj = _delta_net_in_proj(gguf, i, specs, parts, compact)
        if in_proj is not None:
            out[prefix + "in_proj"] = in_proj
        info = gguf.tensors.get(f"blk.{i}.ssm_out.weight")
        if info is None or info.ggml_type not in KEPT:
            continue
        _, blocks = _unpack(gguf, info, compact)
        if v_rows is not None:
            blocks = columns_in_order(blocks, v_rows)
        if blocks is not None:
            out[prefix + "out_proj"] = kernel_linear(
                [blocks], None, dense.get(prefix + "out_proj.weight") if compact else None
            )
    return out


def _delta_net_dense(
    config: ModelConfig, dense: dict[str, torch.Tensor], prefix: str
) -> dict[str, torch.Tensor]:
    """A DeltaNet layer's q/k/v, z, b and a as dense tensors in kvchat's order, from the
    converted weights (Qwen3-Next's fused pairs split); empty where they are missing."""
    qkvz, ba = dense.get(prefix + "in_proj_qkvz.weight"), dense.get(prefix + "in_proj_ba.weight")
    if qkvz is not None and ba is not None:
        assert config.delta_net is not None
        split = split_qwen3_next(config.delta_net, qkvz, ba)
        return dict(zip(("qkv", "z", "b", "a"), split, strict=True))
    found = {p: dense.get(f"{prefix}in_proj_{p}.weight") for p in ("qkv", "z", "b", "a")}
    return {p: t for p, t in found.items() if t is not None}


def _delta_net_in_proj(
    gguf: GGUFFile,
    layer: int,
    specs: list[tuple[str, torch.Tensor | None, tuple[str, ...]]],
    parts: dict[str, torch.Tensor],
    compact: bool,
) -> Linear | None:
    """The fused in_proj of `delta_net_linears`, or None where q/k/v or z is not
    quantized (or a dense part it needs is missing)."""
    infos = [gguf.tensors.get(f"blk.{layer}.{name}.weight") for name, _, _ in specs]
    if any(info is None or info.ggml_type not in KEPT for info in infos[:2]):
        return None
    runs: list[tuple[object, list[tuple], list[str]]] = []  # (form, its parts' blocks, names)
    for info, (_, rows, names) in zip(infos, specs, strict=True):
        if info is not None and info.ggml_type in KEPT:
            form, b = _unpack(gguf, info, compact)
            b = b if rows is None else tuple(t[rows] for t in b)
        elif all(n in parts for n in names):
            form, b = "dense", None
        else:
            return None
        if not runs or runs[-1][0] != form:
            runs.append((form, [], []))
        if b is not None:
            runs[-1][1].append(b)
        runs[-1][2].extend(names)
    linears: list[Linear] = []
    for form, blocks, names in runs:
        copy = form == "dense" or (compact and all(n in parts for n in names))
        weight = torch.cat([parts[n] for n in names]) if copy else None
        if form == "dense":
            assert weight is not None
            linears.append(DenseLinear(weight))
        else:
            linears.append(kernel_linear(blocks, None, weight))
    return linears[0] if len(linears) == 1 else StackedLinear(linears)


def columns_in_order(blocks: tuple, columns: torch.Tensor) -> tuple | None:
    """A matrix's unpacked blocks (`unpacked`) with its columns taken in `columns`' order,
    where that moves whole scale groups only; None where it would split one. K-quants'
    super-scales are multiplied into their groups' scales first."""
    codes, *scales = blocks
    if codes.dtype == torch.int8 and len(scales) == 2:  # Q6_K's sub-scales, super-scales
        scales = [expanded(scales[0], scales[1])]
    elif len(scales) == 4:  # Q4_K's sub-scales and sub-mins, their super-scales
        scales = [expanded(scales[0], scales[2]), expanded(scales[1], scales[3])]
    group = codes.shape[1] // scales[0].shape[1]
    if columns.numel() % group:
        return None
    runs = columns.view(-1, group)
    starts = runs[:, 0]
    if bool((starts % group).any()) or not torch.equal(runs, starts[:, None] + torch.arange(group)):
        return None
    return (codes[:, columns], *(t[:, starts // group] for t in scales))
