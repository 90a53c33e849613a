"""torch's attention on a CPU, called only with shapes from a small fixed set.

In bf16 on a CPU with AMX, torch's flash attention multiplies each block with a oneDNN
brgemm kernel that it generates for the block's shape and keeps, per thread, for the
life of the process, without a limit. A block's shape follows the call's query rows and
key count, so prefill chunks of ever new lengths over ever longer histories made a
long-running kvchat grow by about 0.3 MiB a new shape, without end (the soak:
docs/reliability.md). Calls with fewer than `ROW_GRANULE` query rows take another path
in torch and build nothing.

Every call kvchat makes with more rows goes through here and reaches torch with its
query rows a multiple of `ROW_GRANULE` and its keys a multiple of `KEY_GRANULE` (or of
the page size, for runs of whole pages read in place): zero rows and keys appended, the
keys masked out, the extra outputs dropped. The tails of torch's blocks then take a
handful of values, and the kernels are built once. Causal calls need no mask: their
queries and keys are the same tokens, and an appended query row is only ever seen by
other appended rows.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ROW_GRANULE = 32  # fewer query rows: torch's flash attention builds no kernel (measured)
KEY_GRANULE = 64


def _ceil(n: int, granule: int) -> int:
    return -(-n // granule) * granule


def _bounded(q: torch.Tensor) -> bool:
    """Whether this call's shapes need rounding: a CPU call with many query rows."""
    return q.device.type == "cpu" and q.shape[-2] >= ROW_GRANULE


def _pad_rows(x: torch.Tensor, rows: int) -> torch.Tensor:
    """`x [..., n, D]` with zero rows appended up to `rows`."""
    extra = rows - x.shape[-2]
    return F.pad(x, (0, 0, 0, extra)) if extra else x


def causal_length(n: int, device: torch.device) -> int:
    """The tokens `causal` passes to torch for `n` on `device`: a caller that copies its
    keys anyway can append the zero rows in the same copy."""
    return _ceil(n, KEY_GRANULE) if device.type == "cpu" and n >= ROW_GRANULE else n


def causal(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, enable_gqa: bool = False
) -> torch.Tensor:
    """Causal self-attention, q `[B, Hq, n, D]` over k/v `[B, Hkv, n, D]` (the same
    tokens, the first query row at the first key); inputs already `causal_length` long
    (zero rows at the end) are passed as they are, and the output is as long."""
    n = q.shape[-2]
    size = causal_length(n, q.device)
    q, k, v = (_pad_rows(x, size) for x in (q, k, v))
    out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=enable_gqa)
    return out[..., :n, :]


def causal_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """As `causal` with as many kv heads as query heads, on a CPU, also returning each
    row's log-sum-exp `[B, H, n]` (to merge it with attention over other keys)."""
    n = q.shape[-2]
    size = causal_length(n, q.device)
    q, k, v = (_pad_rows(x, size) for x in (q, k, v))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, is_causal=True)
    return out[..., :n, :], lse[..., :n]


def over_keys_with_lse(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, key_granule: int = KEY_GRANULE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Every query row `[B, H, M, D]` over all keys `[B, H, L, D]`, on a CPU, with each
    row's log-sum-exp. Keys already a multiple of `key_granule` are read as they are
    (runs of whole pages in place); others are copied with masked zero keys appended."""
    m, length = q.shape[-2], k.shape[-2]
    if not _bounded(q):
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v)
    q = _pad_rows(q, _ceil(m, ROW_GRANULE))
    mask = None
    if length % key_granule:
        size = _ceil(length, KEY_GRANULE)
        k, v = _pad_rows(k, size), _pad_rows(v, size)
        mask = _key_mask(length, size, q.dtype, q.device)
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, attn_mask=mask)
    return out[..., :m, :], lse[..., :m]


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """q `[B, H, M, D]` over k/v `[B, H, L, D]`, with an optional additive `mask`
    `[..., M, L]` (0 where a row sees a key, -inf where not). A mask already grown by
    `pad_mask` to `padded_shape` (built once for all layers) is used as it is."""
    m, length = q.shape[-2], k.shape[-2]
    rows, size = padded_shape(m, length, q.device)
    if (rows, size) == (m, length):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    if mask is None:  # only the appended keys to block: one row, broadcast
        mask = _key_mask(length, size, q.dtype, q.device)
    else:
        mask = pad_mask(mask, rows, size)
    q, k, v = _pad_rows(q, rows), _pad_rows(k, size), _pad_rows(v, size)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return out[..., :m, :]


def padded_shape(m: int, length: int, device: torch.device) -> tuple[int, int]:
    """The (query rows, keys) that `attend` passes to torch for `m` rows over `length`
    keys on `device`."""
    if device.type != "cpu" or m < ROW_GRANULE:
        return m, length
    return _ceil(m, ROW_GRANULE), _ceil(length, KEY_GRANULE)


def pad_mask(mask: torch.Tensor, rows: int, keys: int) -> torch.Tensor:
    """An additive mask `[..., M, L]` grown to `[..., rows, keys]` (a mask of one row is
    broadcast and keeps it): the new keys blocked, the new rows seeing what the first row
    sees, so that no row is blocked everywhere. A mask of that size already: as it is."""
    m, length = mask.shape[-2], mask.shape[-1]
    if keys > length:
        mask = F.pad(mask, (0, keys - length), value=float("-inf"))
    if rows > m > 1:
        mask = torch.cat([mask, mask[..., :1, :].expand(*mask.shape[:-2], rows - m, keys)], -2)
    return mask


def _key_mask(length: int, size: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`[1, size]`: 0 for the first `length` keys, -inf for the appended ones."""
    mask = torch.zeros(1, size, dtype=dtype, device=device)
    mask[:, length:] = float("-inf")
    return mask
