"""Paged attention through torch's FlexAttention, compiled: the attention kvchat runs on CUDA.

The store is read in place: one layer's K (or V) `[pages, page_size, kv_heads, head_dim]`
is viewed as ONE long sequence `[1, kv_heads, pages * page_size, head_dim]` (no copy),
and each step's sequences are the batch of the query: `q [B, Hq, Lq, D]`, each sequence's
new tokens padded to the longest. A `BlockMask` says which pages each block of a
sequence's queries reads: kv block = page, so its indices are the sequence's own page
list, "full" blocks (pages wholly before the block's first query) skip the mask and the
rest are masked causally through a physical-page -> logical-page map. Grouped-query
heads go through `enable_gqa`, so no K/V is repeated per query head.

A sliding-window layer (Gemma 3's, gpt-oss's) reads through a block mask of its own
window size, built by the first such layer of a forward and shared by the others: its
blocks leave out the pages wholly before every query's window, and the mask adds the
window's bound to the causal one (a query sees the `window - 1` positions before its
own, as `batch.window_mask`). The window is a tensor the mask reads, so windowed and full
layers run the same compiled graph. Attention sinks (gpt-oss: a logit per query head
that joins the softmax's denominator only) are applied after the kernel, exactly, from
the log-sum-exp it returns (`_with_sinks`). torch's compiled CPU kernel returns none, so
on a CPU a layer with sinks runs uncompiled (the tests do; engines there are refused).

Everything a step builds comes from its page lists with tensor ops, not per-token
Python, and a decode-only step whose pages did not change reuses the previous step's
blocks. On a GPU Inductor turns the compiled call into a Triton kernel; on a CPU the
same code compiles to C++, which is how the tests check the page-table and mask logic
the GPU runs. Shapes are kept to a few compiled variants (`dynamic=True`, sizes that
vary never equal 1): past torch's recompile limit FlexAttention would run uncompiled
and score every slot of the store.

The compile cache lives under kvchat's cache folder (`configure_compile_cache`); the
first compile of a shape takes tens of seconds, later starts load it from there.
int8 KV is not read here: its pages would have to be dequantized first, so the engine
refuses that combination at start (`check_kv_format`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

from kvchat.errors import UsageError
from kvchat.model.batch import ForwardBatch

FLEX_INT8_KV = (
    "--attention flex does not read an int8 KV cache; use --kv native with it, "
    "or --attention sdpa to keep --kv int8."
)
FLEX_SINKS_ON_CPU = (
    "--attention flex computes this model's attention sinks on CUDA only (torch's compiled "
    "FlexAttention on a CPU returns no log-sum-exp); on a CPU use --attention native "
    "(its default) or sdpa."
)
# Query rows per block of the mask. A GPU's flex kernels tile 128 query rows at a time
# (their block must divide this); on a CPU smaller blocks skip more of a chunk's future.
Q_BLOCK_GPU = 128
Q_BLOCK_CPU = 16
COMPILE_CACHE_ENV = "TORCHINDUCTOR_CACHE_DIR"
RECOMPILE_LIMIT = 32  # compiled graphs of FlexAttention a process may hold
NO_WINDOW = 1 << 30  # the window of a full-attention layer: farther than any context


def check_kv_format(kv_format: str) -> None:
    """Refuse, with what to do instead, a KV format the flex path does not read."""
    if kv_format != "native":
        raise UsageError(FLEX_INT8_KV)


def configure_compile_cache(folder: os.PathLike | str) -> None:
    """Keep Inductor's compiled kernels under `folder` (unless the user chose a place), so
    the first start pays for the compile and later ones load it."""
    os.environ.setdefault(COMPILE_CACHE_ENV, os.fspath(folder))


@functools.cache
def _compiled_flex():
    # An engine compiles two graphs per dtype (decode steps, steps with chunks; a model with
    # sinks asks for the log-sum-exp too, another pair); a process
    # that makes engines of several store sizes (the bench: one per workload) a pair for
    # each. Room for them before torch stops compiling and runs FlexAttention uncompiled.
    limits = torch._dynamo.config
    limits.recompile_limit = max(limits.recompile_limit, RECOMPILE_LIMIT)
    # Only the sizes `_mark_dynamic` names vary in a compiled graph: with every size
    # symbolic (`dynamic=True`) torch's CPU code generator can mistake one size's name for
    # another's (a C++ compile error)
    return torch.compile(flex_attention)


def _bucket(n: int, floor: int = 2) -> int:
    """`n` rounded up to a power of two, at least `floor`: sizes that are never 1 (torch
    specializes a compiled graph on size 1) and few distinct values."""
    return max(floor, 1 << (max(n, 1) - 1).bit_length())


@dataclass(frozen=True)
class _Blocks:
    """One step's block structure for one window size, reusable while its page lists and
    boundaries hold."""

    kv_num_blocks: torch.Tensor  # [Bp, 1, R] partial (masked) pages per query block
    kv_indices: torch.Tensor  # [Bp, 1, R, W]
    full_num_blocks: torch.Tensor  # [Bp, 1, R] pages every query of the block sees whole
    full_indices: torch.Tensor  # [Bp, 1, R, W]


@dataclass(frozen=True)
class _Step:
    """What one forward's block masks are built from (tensors on the device)."""

    page_matrix: torch.Tensor  # [Bp, >= pages]: row b is sequence b's page list
    starts: torch.Tensor  # [B] each sequence's first new position
    lens: torch.Tensor  # [B] its new tokens
    rows: int  # query blocks per sequence
    q_start: torch.Tensor  # [table_rows] int32: `starts`, the rows past B zero
    decode_key: tuple | None  # a decode step's page lists (its blocks' key); None: chunks
    totals: tuple[int, ...]  # each sequence's context after the step


class FlexPagedAttention:
    """The `Attention` of a forward pass over a `DeviceKVStore`, through FlexAttention."""

    def __init__(
        self,
        k_all: torch.Tensor,
        v_all: torch.Tensor,
        max_batch: int = 16,
        unkept_slot: int | None = None,
    ):
        """K/V stores `[layers, pages, S, Hkv, D]` in the compute dtype; `max_batch`
        sequences a step carries at most (more are served, at the cost of a compile).
        `unkept_slot`: a windowed layers' store (`cache.window_slots`), whose page lists
        name this slot for every page whose part was let go: it maps to no position, and
        a sequence's list may be longer than the store has slots."""
        self.unkept_slot = unkept_slot
        self.k_all = k_all
        self.v_all = v_all
        layers, pages, S, Hkv, D = k_all.shape
        self.page_size = int(S)
        self.num_pages = int(pages)
        self.num_kv_heads = int(Hkv)
        self.head_dim = int(D)
        self.scale = self.head_dim**-0.5
        self.q_block = Q_BLOCK_GPU if k_all.device.type == "cuda" else Q_BLOCK_CPU
        # Rows of the tables the mask reads, a size that does not vary with the batch: the
        # CPU compiler mis-names a varying size inside a mask (a C++ compile error)
        self.table_rows = _bucket(max_batch)

        def as_sequence(t: torch.Tensor) -> torch.Tensor:  # [P, S, Hkv, D] -> [1, Hkv, P*S, D]
            return t.view(-1, self.num_kv_heads, self.head_dim).permute(1, 0, 2).unsqueeze(0)

        self._flat_k = [k_all[i].view(-1, Hkv, D) for i in range(layers)]  # [P*S, Hkv, D]
        self._flat_v = [v_all[i].view(-1, Hkv, D) for i in range(layers)]
        self._keys = [as_sequence(k_all[i]) for i in range(layers)]  # views, made once
        self._values = [as_sequence(v_all[i]) for i in range(layers)]
        for t in (*self._keys, *self._values):
            _keep_static(t)
        # per window size (None: full attention): the blocks of the last step that read
        # with it, and the decode key they were built for (None: a step with chunks)
        self._blocks: dict[int | None, tuple[tuple | None, _Blocks]] = {}
        self.blocks_built = 0  # how many times a step built blocks (the rest reused them)
        self._windows: dict[int | None, torch.Tensor] = {}  # each window size, as the mask reads it
        self._step: _Step | None = None
        # [table_rows >= Bp, pages] int32: a page's index in its sequence, or -1
        self._page_to_logical: torch.Tensor | None = None
        self._masks: dict[int | None, BlockMask] = {}  # this forward's, per window size
        self._slots: torch.Tensor | None = None  # [T] flat slot of each new token
        self._rows: tuple[torch.Tensor, torch.Tensor] | None = None  # each token's (seq, row)
        self._padded_shape: tuple[int, int] = (0, 0)  # (Bp, Lq)

    @classmethod
    def for_store(
        cls, store, max_batch: int = 16, unkept_slot: int | None = None
    ) -> FlexPagedAttention:
        """Over a `kv_store.DeviceKVStore` of the native KV format.

        The store is zeroed first: a masked slot of a page still goes through the kernel's
        product with V (weighted 0), and 0 x NaN from never-written memory would be NaN.
        """
        check_kv_format(store.kv_format)
        for part in store.parts:
            part.zero_()
        return cls(store.k_all, store.v_all, max_batch, unkept_slot)

    def uses_native(self) -> bool:
        return False

    # ---- per forward -----------------------------------------------------------------------

    def prepare(self, batch: ForwardBatch, page_lists: Sequence[Sequence[int]]) -> None:
        """Where each new token goes and what its block masks are built from, once per
        forward; each window size's mask is built by the first layer that reads with it.

        The page lists go to the device in one copy; the rest is tensor ops there.
        """
        device = self.k_all.device
        S = self.page_size
        lens = list(batch.query_lens)
        totals = list(batch.context_lens)
        used = [(t + S - 1) // S for t in totals]
        B, T = len(lens), sum(lens)
        Bp = _bucket(B)
        decode = batch.is_decode_only
        Lq = 1 if decode else _bucket(max(lens), 2 * self.q_block)
        pages = [tuple(p[:u]) for p, u in zip(page_lists, used, strict=True)]
        flat_list = [p for seq in pages for p in seq]
        table = torch.tensor([*lens, *totals, *used, *flat_list], dtype=torch.long).to(device)
        lens_t, totals_t, used_t = table[:B], table[B : 2 * B], table[2 * B : 3 * B]
        flat = table[3 * B :]  # every sequence's used pages, back to back
        starts_t = totals_t - lens_t  # each sequence's first new position
        seq_of_page = _runs_index(used_t, len(flat_list))
        logical = torch.arange(len(flat_list), device=device) - _run_starts(used_t)[seq_of_page]
        width = max(self.num_pages, *used)  # a windowed store's lists outgrow its slots
        page_matrix = torch.zeros(Bp, width, dtype=torch.long, device=device)
        page_matrix[seq_of_page, logical] = flat  # [Bp, W]: row b is sequence b's page list

        # A decode-only step reads the page map of the previous one until a sequence's
        # context spills into a new page or the table gives it other pages; its blocks too,
        # but for those of a window whose start moved (`block_mask`).
        decode_key = (Lq, tuple(pages)) if decode else None
        previous = None if self._step is None else self._step.decode_key
        if decode_key is None or decode_key != previous or self._page_to_logical is None:
            self.table_rows = max(self.table_rows, Bp)
            page_to_logical = torch.full(
                (self.table_rows, self.num_pages), -1, dtype=torch.int32, device=device
            )
            kept = slice(None) if self.unkept_slot is None else flat != self.unkept_slot
            page_to_logical[seq_of_page[kept], flat[kept]] = logical[kept].to(torch.int32)
            _keep_static(page_to_logical)
            self._page_to_logical = page_to_logical

        # each new token: its sequence, its row among that sequence's queries, its slot
        seq_of_token = _runs_index(lens_t, T)
        row_of_token = torch.arange(T, device=device) - _run_starts(lens_t)[seq_of_token]
        positions = starts_t[seq_of_token] + row_of_token
        self._slots = page_matrix[seq_of_token, positions // S] * S + positions % S
        self._rows = (seq_of_token, row_of_token)
        self._padded_shape = (Bp, Lq)
        q_start = torch.zeros(self.table_rows, dtype=torch.int32, device=device)
        q_start[:B] = starts_t.to(torch.int32)
        _keep_static(q_start)
        rows = 1 if decode else Lq // self.q_block
        self._step = _Step(page_matrix, starts_t, lens_t, rows, q_start, decode_key, tuple(totals))
        self._masks = {}

    def block_mask(self, window: int | None = None) -> BlockMask:
        """The block mask of this forward's layers that attend within `window` (None: the
        whole context), built by the first of them. A decode step reuses the previous
        step's blocks while its page lists, and its window's first pages, hold."""
        mask = self._masks.get(window)
        if mask is not None:
            return mask
        step = self._step
        assert step is not None and self._page_to_logical is not None
        key = None
        if step.decode_key is not None:
            key = (step.decode_key, self._window_starts(step.totals, window))
        built = self._blocks.get(window)
        if key is None or built is None or built[0] != key:
            built = (key, self._build_blocks(step, window))
            self._blocks[window] = built
            self.blocks_built += 1
        mask = self._masks[window] = self._block_mask(built[1], step.q_start, window)
        return mask

    def _window_starts(self, totals: tuple[int, ...], window: int | None) -> tuple:
        """What a decode's blocks in `window` depend on beside its page list: the page where
        its window starts, and whether it starts that page's first slot."""
        if window is None:
            return ()
        S = self.page_size
        firsts = [max(0, t - window) for t in totals]  # a decode at t - 1 sees from t - window
        return tuple((f // S, f % S == 0) for f in firsts)

    def _build_blocks(self, step: _Step, window: int | None) -> _Blocks:
        """The pages each block of `q_block` query rows reads, split into full and masked.

        Block r of sequence b holds its queries r*QB .. (r+1)*QB-1, at positions from
        `first_pos` to `last_pos`; it reads the sequence's logical pages `first` ..
        needed-1: from the page where the first query's window starts (0 without a
        window) to the last query's page. Pages `full_from` .. `before`-1 are full: each
        query's window covers them whole and they end before the page of `first_pos`. The
        rest, the window's edge `first` .. `full_from`-1 and the causal edge `before` ..
        needed-1, are masked.
        """
        S, QB = self.page_size, self.q_block
        W = NO_WINDOW if window is None else window
        page_matrix = step.page_matrix
        device = page_matrix.device
        Bp, listed = page_matrix.shape
        width = self.num_pages  # as wide as the store: torch's CPU kernel requires it
        B = step.starts.shape[0]
        rows = step.rows
        starts_p = torch.zeros(Bp, dtype=torch.long, device=device)
        lens_p = torch.zeros(Bp, dtype=torch.long, device=device)  # padding: no queries
        starts_p[:B], lens_p[:B] = step.starts, step.lens
        first_row = torch.arange(rows, device=device) * QB  # [R]
        valid = first_row[None, :] < lens_p[:, None]  # [Bp, R]
        last_row = torch.minimum(first_row[None, :] + QB, lens_p[:, None]) - 1
        first_pos = starts_p[:, None] + first_row[None, :]
        last_pos = starts_p[:, None] + last_row
        needed = torch.where(valid, last_pos // S + 1, 0)
        # pages wholly before the block's first query (its own page stays masked even when
        # the query is its last slot: so a decode's blocks change only with its page count)
        before = torch.where(valid, torch.minimum(first_pos // S, needed), 0)
        # the first page the first query's window reaches; the first the last one's covers
        first = torch.where(valid, (first_pos - W + 1).clamp(min=0) // S, 0)
        covered = ((last_pos - W + 1).clamp(min=0) + S - 1) // S
        full_from = torch.where(valid, torch.minimum(covered, before), 0)
        k = torch.arange(width, device=device)
        edge = (full_from - first)[:, :, None]  # masked pages at the window's edge
        partial_at = torch.where(
            k < edge, first[:, :, None] + k, before[:, :, None] + k - edge
        ).clamp(max=listed - 1)
        full_at = (full_from[:, :, None] + k).clamp(max=listed - 1)
        by_row = page_matrix[:, None, :].expand(Bp, rows, listed)

        def shaped(t: torch.Tensor) -> torch.Tensor:  # [Bp, R(, W)] -> [Bp, 1, R(, W)] int32
            return t.unsqueeze(1).to(torch.int32).contiguous()

        return _Blocks(
            kv_num_blocks=shaped(full_from - first + needed - before),
            kv_indices=shaped(by_row.gather(2, partial_at)),
            full_num_blocks=shaped(before - full_from),
            full_indices=shaped(by_row.gather(2, full_at)),
        )

    def _block_mask(self, blocks: _Blocks, q_start: torch.Tensor, window: int | None) -> BlockMask:
        S = self.page_size
        page_to_logical = self._page_to_logical
        assert page_to_logical is not None and self._step is not None
        span = self._windows.get(window)
        if span is None:  # a tensor, not a constant: one compiled graph for every window
            value = NO_WINDOW if window is None else window
            span = torch.tensor(value, dtype=torch.int32, device=q_start.device)
            _keep_static(span)
            self._windows[window] = span
        Lq = self._padded_shape[1]

        def causal_in_own_pages(b, h, q_idx, kv_idx):
            # Only the sequence's own pages are in its blocks, but torch's uncompiled fallback
            # (past its recompile limit) reads every page: pages of others are -1
            logical = page_to_logical[b, kv_idx // S]
            position = logical * S + kv_idx % S
            newest = q_start[b] + q_idx
            return (logical >= 0) & (position <= newest) & (position > newest - span)

        return BlockMask.from_kv_blocks(
            blocks.kv_num_blocks,
            blocks.kv_indices,
            blocks.full_num_blocks,
            blocks.full_indices,
            BLOCK_SIZE=(self.q_block, S),
            mask_mod=causal_in_own_pages,
            seq_lengths=(Lq, self.num_pages * S),
            compute_q_blocks=False,  # only a backward pass reads them
        )

    # ---- per layer -------------------------------------------------------------------------

    def __call__(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *,
        window: int | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]; stores k/v at their slots first.

        `window`: each query sees its own position and the `window - 1` before it;
        `sinks` [Hq]: a logit per query head in the softmax's denominator."""
        assert self._slots is not None and self._rows is not None
        mask = self.block_mask(window)
        k_flat, v_flat = self._flat_k[layer], self._flat_v[layer]
        k_flat.index_copy_(0, self._slots, k.to(k_flat.dtype))
        v_flat.index_copy_(0, self._slots, v.to(v_flat.dtype))
        Bp, Lq = self._padded_shape
        Hq, D = q.shape[1:]
        seq, row = self._rows
        with torch.inference_mode():  # as in the forward pass: one graph whoever calls
            padded = q.new_zeros(Bp, Lq, Hq, D)
            padded[seq, row] = q
            padded = padded.transpose(1, 2)  # [Bp, Hq, Lq, D]
            _mark_dynamic(padded, mask, chunks=Lq > 1)
            attend = functools.partial(
                _compiled_flex(),
                padded,
                self._keys[layer],  # [1, Hkv, P*S, D]: the store, in place
                self._values[layer],
                block_mask=mask,
                scale=self.scale,
                enable_gqa=True,
            )
            if sinks is None:
                return attend().transpose(1, 2)[seq, row]  # [Bp, Hq, Lq, D] -> [T, Hq, D]
            if padded.device.type == "cpu":
                # torch's compiled CPU kernel returns no log-sum-exp: on a CPU (the tests';
                # `resolve_attention` keeps engines off it) torch's uncompiled FlexAttention
                # computes a layer with sinks, scoring every slot of the store
                attend = functools.partial(flex_attention, *attend.args, **attend.keywords)
            out, aux = attend(return_aux=AuxRequest(lse=True))
            lse = aux.lse.transpose(1, 2)[seq, row]  # [Bp, Hq, Lq] -> [T, Hq], natural log
            return _with_sinks(out.transpose(1, 2)[seq, row], lse, sinks)


def _with_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """Attention `out` [T, Hq, D] whose softmax had the log-sum-exp `lse` [T, Hq], as if
    each head's sink logit `sinks` [Hq] had joined its denominator with no value.

    The sink only grows the denominator: every weight shrinks by exp(lse) / (exp(lse) +
    exp(sink)) = sigmoid(lse - sink), computed in float32 as `batch.reference_attention`
    computes the softmax."""
    kept = torch.sigmoid(lse.float() - sinks.float())  # [T, Hq]
    return (out.float() * kept[..., None]).to(out.dtype)


def _mark_dynamic(query: torch.Tensor, mask: BlockMask, *, chunks: bool) -> None:
    """Compile one graph for every batch size (and, with chunks, every chunk length) from
    the first call, rather than one for the first size and another when it changes."""
    blocks = (mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices)
    for t in (query, *blocks):
        torch._dynamo.maybe_mark_dynamic(t, 0)  # the batch
        if chunks:
            torch._dynamo.maybe_mark_dynamic(t, 2)  # query rows, or blocks of them


def _keep_static(t: torch.Tensor) -> None:
    """Compile for this tensor's sizes as they are. Without it, a second store size in one
    process (the tests') makes torch generalize the store's sizes and offsets, and then
    recompile for every layer's view of the store until it gives up compiling."""
    torch._dynamo.mark_static(t)


def _run_starts(lengths: torch.Tensor) -> torch.Tensor:
    """Where each run starts when runs of these lengths are laid back to back."""
    return torch.cumsum(lengths, 0) - lengths


def _runs_index(lengths: torch.Tensor, total: int) -> torch.Tensor:
    """For each element of the runs laid back to back, the index of its run (`total`, the
    sum of `lengths`, is given so a GPU does not wait to learn the output's size)."""
    runs = torch.arange(lengths.shape[0], device=lengths.device)
    return torch.repeat_interleave(runs, lengths, output_size=total)
