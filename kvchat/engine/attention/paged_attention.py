"""Attention that reads and writes K/V through each sequence's page list.

The store is one K and one V tensor shaped [layers, pages, page_size, kv_heads,
head_dim]; a sequence's token at position p lives in page `pages[p // S]`, slot
`p % S`. `prepare()` turns a batch and its page lists into flat slot indices once
per forward; every layer then writes its new K/V with one `index_copy_` and reads
each sequence's context either as a plain slice (when its pages are one run, as the
page table's allocation and defragmentation try to leave them) or with one gather.

On a CPU, once kvchat's own kernel is compiled and loaded (`native_attention`), every
layer runs ONE kernel call for all the step's decodes, reading K/V in place through
the page lists. Prefill chunks join them where the kernel is the faster of the two on
this CPU (`native_attention.serves_chunks`: bf16 without AMX tiles); elsewhere they stay
on SDPA, which on a CPU reads a cached prefix in place too, run of pages by run of
pages (`_attend_by_runs`). Without the kernel, and
on other devices: decode-only batches run one SDPA call for all sequences (padded and
masked when there are several; a single sequence with a long context is sliced into a
batch of parts merged by log-sum-exp, so both cores share the work); prefill chunks
run SDPA per sequence, causal from the first new token on. Both fold grouped-query
heads into query rows, so K/V stream once per kv head rather than once per query head.
Every call into torch's attention on a CPU goes through `flash_shapes`, which rounds
its shapes so that torch builds a bounded number of kernels over a process's life.

A sliding-window layer (Gemma 3's, gpt-oss's) whose sequences all fit their window is
full attention and takes the paths above. Once a context outgrows the window, that layer
reads each sequence's last `window - 1` positions before its first new token and its
new tokens, gathered, in one masked call (`_attend_gathered`): at decode a window's
worth of keys, not the whole context. Where the kernel serves every sequence of the
step (decodes, and chunks where it serves chunks), it is given the window: each
sequence's context is read in place from its first query's window on, and each row
masks what lies before its own. A layer with attention
sinks (gpt-oss) always takes the gathered path: its softmax has a column no kernel here
computes (`batch.reference_attention`).

It stays one module: `prepare` decides once per forward which of these paths each
sequence takes, and every layer's call follows that decision with the same slots.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvchat.engine.attention import flash_shapes, native_attention
from kvchat.model.batch import ForwardBatch, reference_attention, window_mask

# A chunk's scattered context is read in at most this many runs of pages; more: one
# gathered copy (0: never by runs, one masked call over the whole context: the tests'
# reference).
MAX_PREFIX_RUNS = 8
# A chunk at least this many times longer than its cached prefix is attended in one causal
# call over the whole context (`_attend_after_short_prefix`) rather than part by part.
SHORT_PREFIX_RATIO = 4
SPLIT_DECODE_FROM = 4096  # context tokens from which one decode's attention is sliced (measured)
DECODE_SPLITS = 4


def _merge(outs: list[torch.Tensor], lses: list[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """Attention over parts of a context, merged exactly by their log-sum-exps."""
    weights = torch.softmax(torch.stack(lses), dim=0).unsqueeze(-1)  # float32
    return (torch.stack(outs).float() * weights).sum(dim=0).to(dtype)


def _prefix_runs(pages: Sequence[int], length: int, page_size: int) -> tuple[tuple[int, int], ...]:
    """The first `length` positions of a page list as runs of consecutive pages:
    (first flat slot, tokens) each."""
    runs: list[list[int]] = []
    for j in range((length + page_size - 1) // page_size):
        tokens = min(page_size, length - j * page_size)
        if runs and pages[j] * page_size == runs[-1][0] + runs[-1][1]:
            runs[-1][1] += tokens
        else:
            runs.append([pages[j] * page_size, tokens])
    return tuple((start, tokens) for start, tokens in runs)


@dataclass(frozen=True)
class _FlatKV:
    """One layer's K or V with slots flattened: data `[P*S, Hkv, D]`, int8 scales `[P*S, Hkv]`."""

    data: torch.Tensor
    scale: torch.Tensor | None


@dataclass(frozen=True)
class _ContextView:
    """How one sequence's context is read: a contiguous slot range, or gathered slots."""

    start: int  # first flat slot when contiguous
    length: int
    gather: torch.Tensor | None  # [L] flat slot indices when not contiguous
    pages: torch.Tensor | None = None  # [n] page indices when not contiguous
    # A prefill chunk after a cached prefix, on a CPU: the prefix's whole pages as runs of
    # consecutive pages (first flat slot, tokens), attended part by part, and the slots of
    # the rest: the prefix's partial last page, then the new tokens
    prefix_runs: tuple[tuple[int, int], ...] | None = None
    new_slots: torch.Tensor | None = None


@dataclass(frozen=True)
class _GatheredRead:
    """What one sequence's new tokens read in a layer that gathers its keys."""

    first_row: int  # its first new token among the batch's
    queries: int
    slots: torch.Tensor  # [L] flat slots of the keys it reads, in position order
    mask: torch.Tensor | None  # [n, L] True where attended; None: every key (one query)


class PagedAttention:
    def __init__(
        self,
        k_all: torch.Tensor,
        v_all: torch.Tensor,
        k_scale_all: torch.Tensor | None = None,
        v_scale_all: torch.Tensor | None = None,
    ):
        """K/V stores `[layers, pages, S, Hkv, D]`; for int8, scales `[layers, pages, S, Hkv]`.

        int8 K/V are quantized per token and head on write (scale = max|x| / 127) and
        dequantized on read for one sequence's context at a time, never the whole cache.
        """
        self.k_all = k_all  # [layers, pages, S, Hkv, D]
        self.v_all = v_all
        self.k_scale_all = k_scale_all
        self.v_scale_all = v_scale_all
        self.quantized = k_scale_all is not None
        self.compute_dtype = k_scale_all.dtype if k_scale_all is not None else k_all.dtype
        self.page_size = int(k_all.shape[2])
        self.num_kv_heads = int(k_all.shape[3])
        self.head_dim = int(k_all.shape[4])
        self._masks: dict[int, torch.Tensor] = {}  # per sequence of a prefill: made by layer 0
        self._layers = [self._make_flat(i) for i in range(k_all.shape[0])]  # views, made once
        self.scale = self.head_dim**-0.5
        self._batch: ForwardBatch | None = None
        self._page_lists: Sequence[Sequence[int]] = ()
        # per window size (None: no window), made by the first layer of a forward that
        # reads its keys gathered: what each sequence reads (`_GatheredRead`)
        self._gathered_plans: dict[int | None, list[_GatheredRead]] = {}
        self._slots: torch.Tensor | None = None
        self._views: list[_ContextView | None] = []  # None: read by the kernel
        self._decode_index: torch.Tensor | None = None
        self._decode_mask: torch.Tensor | None = None
        self._native: tuple[torch.Tensor, ...] | None = None  # page lists etc. for the kernel
        self._native_rows: torch.Tensor | None = None  # q rows of the kernel's sequences
        self.native_enabled = True  # False: always torch's SDPA (tests compare the two)
        # prefill chunks through the kernel too (where it is faster on this CPU), not SDPA
        self.native_chunks = native_attention.serves_chunks(self.compute_dtype, self.quantized)

    def uses_native(self) -> bool:
        """Whether this forward's attention goes through kvchat's compiled kernel."""
        return self.native_enabled and native_attention.supports(
            self.compute_dtype, self.head_dim, self.k_all.device
        )

    def prepare(self, batch: ForwardBatch, page_lists: Sequence[Sequence[int]]) -> None:
        """Precompute, once per forward, where each new token goes and each context comes from.

        With the kernel loaded, it takes the decodes (one query per sequence), where it
        reads a long context with every core, through their page lists: they get no
        context view (None). Prefill chunks go to it too where `native_chunks` says it
        is faster on this CPU; otherwise they stay on torch's flash attention, whose
        blocked bf16 products on AMX tiles beat the kernel's vector loops once a sequence
        brings many query rows, and on a CPU read their cached prefix run by run, in
        place (`_attend_by_runs`).
        """
        S = self.page_size
        device = self.k_all.device
        native = self.uses_native()
        native_chunks = native and self.native_chunks
        cpu = device.type == "cpu"  # where torch's flash attention returns log-sum-exps
        slots: list[int] = []
        views: list[_ContextView | None] = []
        # the kernel's tables: its sequences' used pages back to back, their offsets,
        # context lengths, and their rows among the batch's tokens
        native_pages: list[int] = []
        native_starts = [0]
        native_contexts: list[int] = []
        native_rows: list[int] = []
        native_q_starts = [0]
        for n, total, pages in zip(batch.query_lens, batch.context_lens, page_lists, strict=True):
            first_row = len(slots)
            for pos in range(total - n, total):
                slots.append(pages[pos // S] * S + pos % S)
            used = (total + S - 1) // S
            if native and (n == 1 or native_chunks):
                native_rows.extend(range(first_row, first_row + n))
                native_q_starts.append(len(native_rows))
                native_pages.extend(pages[:used])
                native_starts.append(len(native_pages))
                native_contexts.append(total)
                views.append(None)
                continue
            if cpu and 1 < n < total and MAX_PREFIX_RUNS > 0:  # a chunk after a prefix
                # the prefix's whole pages in place; its last, partial page's tokens join
                # the new ones (so every run is whole pages: `flash_shapes`)
                whole = (total - n) // S * S
                runs = _prefix_runs(pages, whole, S)
                if len(runs) <= MAX_PREFIX_RUNS:  # read in place
                    tail = [pages[pos // S] * S + pos % S for pos in range(whole, total - n)]
                    new_slots = torch.tensor(tail + slots[first_row:], dtype=torch.long)
                    views.append(_ContextView(0, total, None, None, runs, new_slots))
                    continue
            first = pages[0]
            if all(pages[j] == first + j for j in range(used)):
                views.append(_ContextView(first * S, total, None))
            else:
                page_idx = torch.tensor(pages[:used], dtype=torch.long)
                flat = (page_idx[:, None] * S + torch.arange(S)).reshape(-1)[:total]
                views.append(_ContextView(0, total, flat.to(device), page_idx.to(device)))
        self._batch = batch
        self._page_lists = page_lists
        self._gathered_plans = {}
        self._slots = torch.tensor(slots, dtype=torch.long, device=device)
        self._views = views
        self._masks = {}
        self._decode_index = None
        self._decode_mask = None
        self._native = None
        self._native_rows = None
        if native_rows:
            self._native = (
                torch.tensor(native_pages, dtype=torch.long),
                torch.tensor(native_starts, dtype=torch.long),
                torch.tensor(native_q_starts, dtype=torch.long),
                torch.tensor(native_contexts, dtype=torch.long),
            )
            if len(native_rows) < batch.num_tokens:  # mixed: the kernel's rows among the chunks
                self._native_rows = torch.tensor(native_rows, dtype=torch.long)
        elif batch.is_decode_only and len(views) > 1:
            self._prepare_padded_decode(views)  # type: ignore[arg-type]  # all views set

    def _native_decode(
        self,
        q: torch.Tensor,
        k_flat: _FlatKV,
        v_flat: _FlatKV,
        new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
        window: int | None = None,
    ) -> torch.Tensor:
        assert self._native is not None
        return native_attention.paged_attention(
            q if q.stride(-1) == 1 else q.contiguous(),
            k_flat.data,
            v_flat.data,
            k_flat.scale,
            v_flat.scale,
            *self._native,
            self.page_size,
            self.scale,
            new_kv,
            window,
        )

    def _prepare_padded_decode(self, views: list[_ContextView]) -> None:
        device = self.k_all.device
        longest = max(v.length for v in views)
        index = torch.zeros(len(views), longest, dtype=torch.long, device=device)
        for i, v in enumerate(views):
            index[i, : v.length] = (
                v.gather
                if v.gather is not None
                else torch.arange(v.start, v.start + v.length, device=device)
            )
        lengths = torch.tensor([v.length for v in views], device=device)
        self._decode_index = index  # [B, Lmax]
        padding = torch.arange(longest, device=device)[None, :] >= lengths[:, None]  # [B, Lmax]
        self._decode_mask = self._additive_mask(padding)[:, None, None, :]

    def _additive_mask(self, blocked: torch.Tensor) -> torch.Tensor:
        """0 where attended, -inf where `blocked`, in the compute dtype. Built once per
        forward: SDPA would convert a boolean mask again in every layer (`aten::where`,
        ~2 ms of a W3 mixed step)."""
        mask = torch.zeros(blocked.shape, dtype=self.compute_dtype, device=blocked.device)
        return mask.masked_fill_(blocked, float("-inf"))

    @classmethod
    def for_store(cls, store) -> PagedAttention:
        """Over a `kv_store.DeviceKVStore` (either KV format)."""
        return cls(store.k_all, store.v_all, store.k_scale_all, store.v_scale_all)

    def _make_flat(self, layer: int) -> tuple[_FlatKV, _FlatKV]:
        shape = (-1, self.num_kv_heads, self.head_dim)
        k = self.k_all[layer].view(shape)  # [P*S, Hkv, D]
        v = self.v_all[layer].view(shape)
        if not self.quantized:
            return _FlatKV(k, None), _FlatKV(v, None)
        assert self.k_scale_all is not None and self.v_scale_all is not None
        ks = self.k_scale_all[layer].view(-1, self.num_kv_heads)  # [P*S, Hkv]
        vs = self.v_scale_all[layer].view(-1, self.num_kv_heads)
        return _FlatKV(k, ks), _FlatKV(v, vs)

    def _context(self, flat: _FlatKV, view: _ContextView) -> torch.Tensor:
        """One sequence's K or V `[L, Hkv, D]` in the compute dtype."""
        if view.gather is None:
            data = flat.data[view.start : view.start + view.length]  # a view: no copy
            scale = (
                None if flat.scale is None else flat.scale[view.start : view.start + view.length]
            )
        else:
            # Whole pages at a time: one index_select of page-sized blocks copies the same
            # bytes as a per-slot gather but several times faster (benchmarks/defrag.py).
            S = self.page_size
            assert view.pages is not None
            data = flat.data.view(-1, S, *flat.data.shape[1:])[view.pages]
            data = data.view(-1, *flat.data.shape[1:])[: view.length]
            scale = None
            if flat.scale is not None:
                scale = flat.scale.view(-1, S, flat.scale.shape[1])[view.pages]
                scale = scale.view(-1, flat.scale.shape[1])[: view.length]
        if scale is None:
            return data
        return data.to(scale.dtype) * scale.unsqueeze(-1)

    def _gather(self, flat: _FlatKV, index: torch.Tensor) -> torch.Tensor:
        if flat.scale is None:
            return flat.data[index]
        return flat.data[index].to(flat.scale.dtype) * flat.scale[index].unsqueeze(-1)

    def _write(self, flat: _FlatKV, x: torch.Tensor) -> None:
        """Store the new tokens' K or V `[T, Hkv, D]` at their slots (quantizing for int8)."""
        assert self._slots is not None
        if flat.scale is None:
            flat.data.index_copy_(0, self._slots, x.to(flat.data.dtype))
            return
        scale = (x.abs().amax(dim=-1).float() / 127.0).clamp(min=1e-8)  # [T, Hkv]
        codes = torch.round(x.float() / scale.unsqueeze(-1)).clamp(-127, 127).to(torch.int8)
        flat.data.index_copy_(0, self._slots, codes)
        flat.scale.index_copy_(0, self._slots, scale.to(flat.scale.dtype))

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
        assert self._batch is not None and self._slots is not None, "prepare() first"
        k_flat, v_flat = self._layers[layer]
        all_native = self._native is not None and self._native_rows is None
        if window is not None and max(self._batch.context_lens) <= window:
            window = None  # every sequence fits its window: full attention
        # a window goes to the kernel where it serves every sequence of the step
        if sinks is not None or (window is not None and not all_native):
            self._write(k_flat, k)
            self._write(v_flat, v)
            return self._attend_gathered(q, k_flat, v_flat, window, sinks)
        if all_native and k_flat.scale is None and _kernel_can_store(k_flat, k, v):
            return self._native_decode(q, k_flat, v_flat, (k, v, self._slots), window)
        self._write(k_flat, k)
        self._write(v_flat, v)
        if all_native:
            return self._native_decode(q, k_flat, v_flat, window=window)
        if self._batch.is_decode_only:
            return self._decode(q, k_flat, v_flat)
        return self._prefill(q, k_flat, v_flat)

    def _attend_gathered(
        self,
        q: torch.Tensor,
        k_flat: _FlatKV,
        v_flat: _FlatKV,
        window: int | None,
        sinks: torch.Tensor | None,
    ) -> torch.Tensor:
        """Per sequence, its new tokens over the keys their windows reach (all of the
        context without a window), gathered, masked where a key is past a query's window
        or in its future; sinks in the softmax where given."""
        plan = self._gathered_plans.get(window)
        if plan is None:
            plan = self._gathered_plans[window] = self._plan_gathered(window)
        out = torch.empty_like(q)
        for read in plan:
            rows = slice(read.first_row, read.first_row + read.queries)
            keys = self._gather(k_flat, read.slots)  # [L, Hkv, D]
            values = self._gather(v_flat, read.slots)
            out[rows] = reference_attention(q[rows], keys, values, read.mask, sinks)
        return out

    def _plan_gathered(self, window: int | None) -> list[_GatheredRead]:
        assert self._batch is not None
        S = self.page_size
        device = self.k_all.device
        plan: list[_GatheredRead] = []
        first_row = 0
        for n, total, pages in zip(
            self._batch.query_lens, self._batch.context_lens, self._page_lists, strict=True
        ):
            # where the first query's window starts
            first = 0 if window is None else max(0, total - n - window + 1)
            slots = [pages[p // S] * S + p % S for p in range(first, total)]
            mask = None
            if n > 1:  # one query sees its whole window: no mask
                keys = torch.arange(first, total)
                mask = window_mask(torch.arange(total - n, total), keys, window).to(device)
            plan.append(
                _GatheredRead(
                    first_row, n, torch.tensor(slots, dtype=torch.long, device=device), mask
                )
            )
            first_row += n
        return plan

    def _decode(self, q: torch.Tensor, k_flat: _FlatKV, v_flat: _FlatKV) -> torch.Tensor:
        """One query per sequence, all sequences in one SDPA call (padded, masked when B > 1).

        Grouped-query heads are folded into query rows: the `Hq / Hkv` query heads that
        share a kv head become that head's rows, so the kernel streams each K/V once
        instead of once per query head (`enable_gqa` does the latter). SDPA over permuted
        views beats a hand-written grouped matmul-softmax-matmul in bf16, because bf16 bmm
        on non-contiguous operands copies them first (both measured: docs/kernels.md).
        """
        if self._decode_index is not None:
            return self._decode_padded(q, k_flat, v_flat)
        # a batch of one: the context is a slice or one gather
        view = self._views[0]
        assert view is not None
        keys = self._context(k_flat, view)  # [L, Hkv, D]
        values = self._context(v_flat, view)
        if keys.shape[0] >= SPLIT_DECODE_FROM and q.device.type == "cpu":
            return self._decode_split(q, keys, values)
        return self._grouped_sdpa(q, keys.unsqueeze(0), values.unsqueeze(0), None)

    def _decode_padded(self, q: torch.Tensor, k_flat: _FlatKV, v_flat: _FlatKV) -> torch.Tensor:
        """Several sequences' decode tokens `q [B, Hq, D]` over their contexts, in one call."""
        assert self._decode_index is not None
        keys = self._gather(k_flat, self._decode_index)  # [B, Lmax, Hkv, D]
        values = self._gather(v_flat, self._decode_index)
        return self._grouped_sdpa(q, keys, values, self._decode_mask)  # [B, 1, 1, Lmax], 0/-inf

    def _grouped_sdpa(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask
    ) -> torch.Tensor:
        """q [B, Hq, D] over keys/values [B, L, Hkv, D], query heads folded into kv heads."""
        B, Hq, D = q.shape
        group = Hq // self.num_kv_heads
        rows = q.view(B, self.num_kv_heads, group, D)  # a kv head's query heads as its rows
        keys, values = keys.permute(0, 2, 1, 3), values.permute(0, 2, 1, 3)  # [B, Hkv, L, D]
        out = flash_shapes.attend(rows, keys, values, mask)  # [B, Hkv, group, D]
        return out.reshape(B, Hq, D)

    def _decode_split(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor):
        """One sequence's decode over a long context, as `DECODE_SPLITS` slices in one call.

        The CPU flash kernel gives each (batch, kv head) pair to one thread: with 3 kv
        heads on 2 cores one thread does twice the work of the other. Slicing the context
        into a batch of equal parts makes the work divisible, and the slices' outputs are
        merged exactly with their log-sum-exps (the same result to bf16 rounding). It pays
        off only at long contexts, hence `SPLIT_DECODE_FROM` (measured: docs/kernels.md).
        """
        L, Hkv, D = keys.shape
        Hq = q.shape[1]
        group = Hq // Hkv
        rows = q.view(1, Hkv, group, D)
        step = L // DECODE_SPLITS
        main = step * DECODE_SPLITS

        def sliced(t: torch.Tensor) -> torch.Tensor:  # [parts, Hkv, step, D], a view
            return t[:main].view(DECODE_SPLITS, step, Hkv, D).permute(0, 2, 1, 3)

        out, lse = flash_shapes.over_keys_with_lse(
            rows.expand(DECODE_SPLITS, Hkv, group, D), sliced(keys), sliced(values)
        )  # [parts, Hkv, g, D], [parts, Hkv, g]
        if main < L:  # the remainder, fewer than DECODE_SPLITS tokens
            rest_k = keys[main:].permute(1, 0, 2).unsqueeze(0)
            rest_v = values[main:].permute(1, 0, 2).unsqueeze(0)
            rest_out, rest_lse = flash_shapes.over_keys_with_lse(rows, rest_k, rest_v)
            out = torch.cat([out, rest_out])
            lse = torch.cat([lse, rest_lse])
        return _merge(list(out), list(lse), q.dtype).reshape(1, Hq, D)

    def _prefill(self, q: torch.Tensor, k_flat: _FlatKV, v_flat: _FlatKV) -> torch.Tensor:
        """Per sequence: SDPA over its whole context, causal from its first new token on.

        In a mixed step with the kernel loaded, the decodes' rows come from one kernel call.
        """
        assert self._batch is not None
        out = torch.empty_like(q)
        if self._native_rows is not None:
            out[self._native_rows] = self._native_decode(q[self._native_rows], k_flat, v_flat)
        start = 0
        for i, (n, view) in enumerate(zip(self._batch.query_lens, self._views, strict=True)):
            if view is None:  # a decode the kernel computed above
                start += n
                continue
            if view.prefix_runs is not None:
                out[start : start + n] = self._attend_by_runs(q[start : start + n], k_flat,
                                                              v_flat, view)  # fmt: skip
                start += n
                continue
            qs = q[start : start + n].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
            ks = self._context(k_flat, view).transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
            vs = self._context(v_flat, view).transpose(0, 1).unsqueeze(0)
            offset = view.length - n
            if offset == 0:
                o = flash_shapes.causal(qs, ks, vs, enable_gqa=True)
                out[start : start + n] = o[0].transpose(0, 1)
            else:
                out[start : start + n] = self._attend_after_prefix(i, q[start : start + n], ks, vs)
            start += n
        return out

    def _attend_after_prefix(
        self, seq: int, q: torch.Tensor, ks: torch.Tensor, vs: torch.Tensor
    ) -> torch.Tensor:
        """Causal attention for `n` new tokens `q [n, Hq, D]` that follow a cached prefix.

        As in `_decode`, each kv head's query heads are folded into its rows (token-major,
        so a token's mask row repeats `group` times): K/V stream once per kv head. The
        mask is built by the first layer and reused by the others.
        """
        n, Hq, D = q.shape
        Hkv = self.num_kv_heads
        group = Hq // Hkv
        total = ks.shape[2]
        mask = self._masks.get(seq)
        if mask is None and n > 1:  # a single new token (a decode in a mixed step) sees all
            q_pos = torch.arange(total - n, total, device=q.device)[:, None]
            allowed = torch.arange(total, device=q.device)[None, :] <= q_pos  # [n, L]
            blocked = ~allowed.repeat_interleave(group, dim=0)  # [n * g, L]
            shape = flash_shapes.padded_shape(n * group, total, q.device)
            mask = flash_shapes.pad_mask(self._additive_mask(blocked), *shape)  # once, here
            self._masks[seq] = mask
        rows = q.view(n, Hkv, group, D).permute(1, 0, 2, 3).reshape(1, Hkv, n * group, D)
        o = flash_shapes.attend(rows, ks, vs, mask)  # [1, Hkv, n*g, D]
        return o.view(Hkv, n, group, D).permute(1, 0, 2, 3).reshape(n, Hq, D)

    def _attend_by_runs(
        self, q: torch.Tensor, k_flat: _FlatKV, v_flat: _FlatKV, view: _ContextView
    ) -> torch.Tensor:
        """A chunk's causal attention after a cached prefix, without a mask over the prefix
        and without copying a scattered context.

        Flash attention reads each run of consecutive pages of the prefix in place (every
        new token sees all of it: no mask; query heads folded into their kv head's rows as
        in `_attend_after_prefix`), then the new tokens among themselves (causal, which
        flash attention computes block by block, skipping the future), and the parts are
        merged by their log-sum-exps: the same result as one masked call over the whole
        context, to the rounding of the compute dtype.
        """
        assert view.prefix_runs is not None and view.new_slots is not None
        n, Hq, D = q.shape
        if (view.length - n) * SHORT_PREFIX_RATIO <= n:
            return self._attend_after_short_prefix(q, k_flat, v_flat, view)
        Hkv = self.num_kv_heads
        group = Hq // Hkv
        rows = q.view(n, Hkv, group, D).permute(1, 0, 2, 3).reshape(1, Hkv, n * group, D)
        whole_pages = min(flash_shapes.KEY_GRANULE, self.page_size)  # every run's multiple
        outs: list[torch.Tensor] = []
        lses: list[torch.Tensor] = []
        for first, tokens in view.prefix_runs:
            part = _ContextView(first, tokens, None)
            ks = self._context(k_flat, part).transpose(0, 1).unsqueeze(0)  # [1, Hkv, t, D]
            vs = self._context(v_flat, part).transpose(0, 1).unsqueeze(0)
            o, lse = flash_shapes.over_keys_with_lse(rows, ks, vs, key_granule=whole_pages)
            outs.append(o)
            lses.append(lse)
        # the prefix's partial page (t tokens), then the chunk: the chunk's queries after t
        # rows of zeros, so that each sees the keys up to its own position
        k_new, v_new = self._gather(k_flat, view.new_slots), self._gather(v_flat, view.new_slots)
        t = k_new.shape[0] - n
        q_new = torch.cat([q.new_zeros(t, Hq, D), q]) if t else q

        def heads(x: torch.Tensor) -> torch.Tensor:  # [m, Hkv or Hq, D] -> [1, Hq, m, D]
            x = x.transpose(0, 1)
            if x.shape[0] != Hq:  # grouped K/V: each kv head serves its query heads
                x = x.repeat_interleave(Hq // x.shape[0], dim=0)
            return x.unsqueeze(0)

        o, lse = flash_shapes.causal_with_lse(heads(q_new), heads(k_new), heads(v_new))
        o, lse = o[:, :, t:], lse[:, :, t:]
        outs.append(o[0].view(Hkv, group, n, D).transpose(1, 2).reshape(1, Hkv, n * group, D))
        lses.append(lse[0].view(Hkv, group, n).transpose(1, 2).reshape(1, Hkv, n * group))
        merged = _merge(outs, lses, q.dtype)  # [1, Hkv, n*g, D]
        return merged.view(Hkv, n, group, D).permute(1, 0, 2, 3).reshape(n, Hq, D)

    def _attend_after_short_prefix(
        self, q: torch.Tensor, k_flat: _FlatKV, v_flat: _FlatKV, view: _ContextView
    ) -> torch.Tensor:
        """A long chunk after a short cached prefix: one causal call over the whole context.

        torch's causal attention aligns a query block with the first keys, so the chunk's
        queries are put after `offset` rows of zeros (whose outputs are dropped): row
        `offset + i` then sees exactly the keys up to its own position. The padding costs
        ~offset^2/2 scores, nothing beside a chunk `SHORT_PREFIX_RATIO` times longer; the
        part-by-part path would instead pay, per layer, its merge of two partial outputs
        over every new row and copies of the chunk's queries and keys per query head. The
        common case: a new conversation's first message after the shared system prompt
        (measured: docs/kernels.md).
        """
        assert view.prefix_runs is not None and view.new_slots is not None
        n, Hq, D = q.shape
        offset = view.length - n
        runs = [_ContextView(first, tokens, None) for first, tokens in view.prefix_runs]

        # zero rows appended in the same copies, up to what `flash_shapes.causal` passes on
        end = flash_shapes.causal_length(view.length, q.device) - view.length

        def whole(flat: _FlatKV) -> torch.Tensor:  # the prefix's runs, then the new tokens
            parts = [self._context(flat, run) for run in runs]
            parts.append(self._gather(flat, view.new_slots))
            parts.append(parts[-1].new_zeros(end, *parts[-1].shape[1:]))
            return torch.cat(parts).transpose(0, 1).unsqueeze(0)  # [1, Hkv, L + end, D]

        ks, vs = whole(k_flat), whole(v_flat)
        padded = torch.cat([q.new_zeros(offset, Hq, D), q, q.new_zeros(end, Hq, D)])
        o = flash_shapes.causal(padded.transpose(0, 1).unsqueeze(0), ks, vs, enable_gqa=True)
        return o[0, :, offset : offset + n].transpose(0, 1)


def _kernel_can_store(store: _FlatKV, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the kernel's copy can store these new K/V: the store's dtype, and each
    token's values `[Hkv, D]` contiguous."""
    return all(
        x.dtype == store.data.dtype and x.stride(2) == 1 and x.stride(1) == x.shape[2]
        for x in (k, v)
    )
