"""kvchat's compiled CPU attention kernel: exact against a float64 reference, batch-invariant,
interchangeable with torch's SDPA inside the engine, and optional (no compiler: SDPA)."""

from __future__ import annotations

import random

import pytest
import torch

from kvchat.engine.attention import native_attention
from kvchat.engine.attention.paged_attention import PagedAttention
from kvchat.engine.request import GenerationRequest
from kvchat.model.batch import ForwardBatch
from kvchat.model.loader import load_model
from kvchat.native import build as native_build
from tests.engine_helpers import Collector, small_engine


@pytest.fixture
def kernel(native_kernels) -> None:
    """The kernel must have built wherever a C++ compiler exists; skip only without one."""
    if native_build._compiler() is None or native_build.disabled():
        pytest.skip("no C++ compiler here (or the kernel is turned off)")
    assert native_kernels, native_build.status().detail


def _case(seed: int, dtype, head_dim, page_size, query_lens, context_lens, kv_int8=False):
    """A paged store with each sequence's pages scattered, queries, and the kernel's tables."""
    g = torch.Generator().manual_seed(seed)
    hkv, group = 2, 3
    pages_needed = [(c + page_size - 1) // page_size for c in context_lens]
    num_pages = sum(pages_needed) + 3
    order = list(range(num_pages))
    random.Random(seed).shuffle(order)
    page_lists, at = [], 0
    for n in pages_needed:
        page_lists.append(order[at : at + n])
        at += n
    shape = (num_pages * page_size, hkv, head_dim)
    if kv_int8:
        k = torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)
        v = torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)
        ks = (torch.rand(shape[:2], generator=g) / 50).to(dtype)
        vs = (torch.rand(shape[:2], generator=g) / 50).to(dtype)
    else:
        k = torch.randn(shape, generator=g).to(dtype)
        v = torch.randn(shape, generator=g).to(dtype)
        ks = vs = None
    q = torch.randn(sum(query_lens), hkv * group, head_dim, generator=g).to(dtype)
    return q, k, v, ks, vs, page_lists


def _tables(page_lists, query_lens, context_lens):
    starts, q_starts = [0], [0]
    for p in page_lists:
        starts.append(starts[-1] + len(p))
    for n in query_lens:
        q_starts.append(q_starts[-1] + n)
    return (
        torch.tensor([p for pl in page_lists for p in pl], dtype=torch.long),
        torch.tensor(starts, dtype=torch.long),
        torch.tensor(q_starts, dtype=torch.long),
        torch.tensor(context_lens, dtype=torch.long),
    )


def _reference(q, k, v, ks, vs, page_lists, query_lens, context_lens, page_size, window=None):
    """Causal attention in float64, each sequence's context gathered slot by slot; with a
    window, a query at p sees keys from p - window + 1 on."""
    kd, vd = k.double(), v.double()
    if ks is not None:
        kd, vd = kd * ks.double().unsqueeze(-1), vd * vs.double().unsqueeze(-1)
    group = q.shape[1] // k.shape[1]
    out, start = [], 0
    for pages, n, total in zip(page_lists, query_lens, context_lens, strict=True):
        slots = torch.tensor(
            [pages[t // page_size] * page_size + t % page_size for t in range(total)]
        )
        keys = kd[slots].repeat_interleave(group, 1).transpose(0, 1)  # [Hq, L, D]
        values = vd[slots].repeat_interleave(group, 1).transpose(0, 1)
        queries = q[start : start + n].double().transpose(0, 1)  # [Hq, n, D]
        scores = queries @ keys.transpose(1, 2) / q.shape[2] ** 0.5
        positions = torch.arange(total - n, total)[:, None]
        keys_at = torch.arange(total)[None, :]
        scores = scores.masked_fill(keys_at > positions, float("-inf"))
        if window is not None:
            scores = scores.masked_fill(keys_at <= positions - window, float("-inf"))
        out.append((scores.softmax(-1) @ values).transpose(0, 1))
        start += n
    return torch.cat(out)


CASES = [
    # (query lens, context lens): decodes, a long decode split over many work items, a
    # prefill chunk after a prefix, a fresh prompt, a context ending mid-page
    ((1, 1, 1), (1, 17, 300)),
    ((1,), (1200,)),
    ((20, 1), (700, 33)),
    ((40,), (40,)),
    ((5, 1, 70), (21, 530, 90)),
    # two new tokens: few rows (6) whose causal bounds differ, ending mid-tile
    ((2, 1), (50, 259)),
]


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("head_dim", [16, 64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_int8", [False, True])
def test_kernel_matches_float64_reference(case, head_dim, dtype, kv_int8) -> None:
    query_lens, context_lens = CASES[case]
    page_size = 16 if case % 2 else 64
    q, k, v, ks, vs, page_lists = _case(
        case, dtype, head_dim, page_size, query_lens, context_lens, kv_int8
    )
    out = native_attention.paged_attention(
        q, k, v, ks, vs, *_tables(page_lists, query_lens, context_lens), page_size, head_dim**-0.5
    )
    expected = _reference(q, k, v, ks, vs, page_lists, query_lens, context_lens, page_size)
    assert out.dtype == dtype and out.shape == q.shape
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2  # bf16: the output's own rounding
    assert torch.allclose(out.double(), expected, atol=tol, rtol=tol), (
        (out.double() - expected).abs().max()
    )


WINDOW_CASES = [
    # (query lens, context lens): decodes (the window's start mid-page, a window longer
    # than a work item's split, a context inside its window); chunks whose rows' windows
    # start apart (few rows, and more than 32 rows: every kernel path), a chunk inside
    # its window beside a decode past it
    ((1, 1, 1, 1), (700, 1300, 40, 513)),
    ((2, 1), (600, 259)),
    ((20, 3), (900, 530)),
    ((12, 1), (30, 800)),
]


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("case", range(len(WINDOW_CASES)))
@pytest.mark.parametrize("head_dim", [16, 256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_int8", [False, True])
def test_a_window_bounds_each_query(case, head_dim, dtype, kv_int8) -> None:
    """A sliding-window layer's attention: a query at p sees keys p - window + 1 to p."""
    query_lens, context_lens = WINDOW_CASES[case]
    page_size = 16
    for window in (5, 512):
        q, k, v, ks, vs, page_lists = _case(
            window + case, dtype, head_dim, page_size, query_lens, context_lens, kv_int8
        )
        tables = _tables(page_lists, query_lens, context_lens)
        out = native_attention.paged_attention(
            q, k, v, ks, vs, *tables, page_size, head_dim**-0.5, window=window
        )
        expected = _reference(
            q, k, v, ks, vs, page_lists, query_lens, context_lens, page_size, window
        )
        full = _reference(q, k, v, ks, vs, page_lists, query_lens, context_lens, page_size)
        tol = 1e-5 if dtype == torch.float32 else 1.6e-2
        assert torch.allclose(out.double(), expected, atol=tol, rtol=tol), (
            (out.double() - expected).abs().max()
        )
        assert not torch.allclose(full, expected, atol=0.05)  # the window mattered


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_stores_new_kv_and_reads_q_from_the_fused_projection(dtype) -> None:
    """A decode step hands the kernel views of the fused qkv rows: it stores each new
    token's K/V at its slot, then attends, as the separate copy and a contiguous q would."""
    query_lens, context_lens = (1, 1), (40, 300)
    page_size, hkv, group, dim = 16, 2, 3, 64
    _, k, v, _, _, page_lists = _case(3, dtype, dim, page_size, query_lens, context_lens)
    slots = torch.tensor(
        [
            pl[(c - 1) // page_size] * page_size + (c - 1) % page_size
            for pl, c in zip(page_lists, context_lens, strict=True)
        ]
    )
    g = torch.Generator().manual_seed(9)
    qkv = torch.randn(2, (hkv * group + 2 * hkv) * dim, generator=g).to(dtype)  # fused rows
    q_view = qkv[:, : hkv * group * dim].view(2, hkv * group, dim)
    k_new = qkv[:, hkv * group * dim : (hkv * group + hkv) * dim].view(2, hkv, dim)
    v_new = qkv[:, (hkv * group + hkv) * dim :].view(2, hkv, dim)
    tables = _tables(page_lists, query_lens, context_lens)
    k_copy, v_copy = k.clone(), v.clone()
    k_copy[slots], v_copy[slots] = k_new, v_new
    expected = native_attention.paged_attention(
        q_view.contiguous(), k_copy, v_copy, None, None, *tables, page_size, dim**-0.5
    )
    out = native_attention.paged_attention(
        q_view, k, v, None, None, *tables, page_size, dim**-0.5, new_kv=(k_new, v_new, slots)
    )
    assert torch.equal(k, k_copy) and torch.equal(v, v_copy)
    assert torch.equal(out, expected)


@pytest.mark.usefixtures("kernel")
def test_a_sequence_gets_the_same_bits_whatever_it_is_batched_with() -> None:
    """Work is split by each sequence's own lengths, never the batch's: greedy and seeded
    sampling stay reproducible whatever else is running."""
    query_lens, context_lens = (1, 1, 1, 30), (900, 40, 2500, 300)
    q, k, v, _, _, page_lists = _case(7, torch.bfloat16, 64, 16, query_lens, context_lens)
    together = native_attention.paged_attention(
        q, k, v, None, None, *_tables(page_lists, query_lens, context_lens), 16, 0.125
    )
    alone = native_attention.paged_attention(
        q[:1], k, v, None, None, *_tables(page_lists[:1], (1,), (900,)), 16, 0.125
    )
    assert torch.equal(together[:1], alone)


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize(
    ("mixed", "chunks_in_kernel", "dtype"),
    [
        (False, False, torch.float32),
        (True, False, torch.float32),
        (True, True, torch.float32),
        (True, True, torch.bfloat16),
    ],
)
def test_paged_attention_gives_the_same_result_with_and_without_the_kernel(
    mixed, chunks_in_kernel, dtype
) -> None:
    """Decodes through the kernel, in a decode-only step and beside prefill chunks over
    scattered pages and over one run of pages (flash attention, or the kernel too where
    it serves chunks: one call for the whole step, which stores the new K/V itself)."""
    g = torch.Generator().manual_seed(3)
    layers, pages, page, hkv, group, d = 1, 56, 16, 2, 3, 64
    k_all = torch.randn(layers, pages, page, hkv, d, generator=g).to(dtype)
    v_all = torch.randn(layers, pages, page, hkv, d, generator=g).to(dtype)
    page_lists = [list(range(0, 7)), [20, 19, 18]]
    if mixed:
        runs = [[5], [6], list(range(9, 21)), list(range(3, 15)), list(range(7, 77))]
        starts = [100, 37, 150, 50, 20]
        page_lists += [
            [30, 22, 31, 23, 32, 24, 33, 25, 34, 26, 35],  # scattered
            [40, 41, 42, 43],  # one run: flash attention over a slice
            [50, 45, 51, 46, 52, 47],  # scattered, longer
        ]
        kernel_rows = [0, 1]
    else:
        runs, starts, kernel_rows = [[5], [6]], [100, 37], [0, 1]
    batch = ForwardBatch.from_runs(runs, starts)
    q = torch.randn(batch.num_tokens, hkv * group, d, generator=g).to(dtype)
    k_new = torch.randn(batch.num_tokens, hkv, d, generator=g).to(dtype)
    v_new = torch.randn(batch.num_tokens, hkv, d, generator=g).to(dtype)

    def run(native: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        attention = PagedAttention(k_all.clone(), v_all.clone())
        attention.native_enabled = native
        attention.native_chunks = chunks_in_kernel
        attention.prepare(batch, page_lists)
        assert (attention._native is not None) == native
        if native and mixed and not chunks_in_kernel:
            assert attention._native_rows is not None
            assert attention._native_rows.tolist() == kernel_rows
        if native and chunks_in_kernel:
            assert attention._native_rows is None and attention._views == [None] * len(runs)
        return attention(0, q, k_new, v_new), attention.k_all, attention.v_all

    out, k_after, v_after = run(True)
    expected, k_expected, v_expected = run(False)
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2  # bf16: the outputs' own rounding
    assert torch.allclose(out.float(), expected.float(), atol=tol, rtol=tol)
    assert torch.equal(k_after, k_expected) and torch.equal(v_after, v_expected)


@pytest.mark.usefixtures("kernel")
@pytest.mark.parametrize("chunks_in_kernel", [False, True])
def test_engine_greedy_output_is_the_same_with_the_kernel_and_with_sdpa(
    tiny_llama_dir, chunks_in_kernel
) -> None:
    model = load_model(str(tiny_llama_dir), dtype="float32", device="cpu")
    assert model.config.head_dim in native_attention.HEAD_DIMS
    prompts = [[3 + (i * 7 + j) % 90 for j in range(10 + 13 * i)] for i in range(4)]

    def run(native: bool) -> list[tuple[int, ...]]:
        with small_engine(model, attention="native" if native else "sdpa") as engine:
            engine.attention.native_chunks = chunks_in_kernel
            collectors = [Collector() for _ in prompts]
            for prompt, c in zip(prompts, collectors, strict=True):
                engine.submit(GenerationRequest(tuple(prompt), max_tokens=40, ignore_eos=True), c)
            outputs = [c.wait().generated_ids for c in collectors]
            assert engine.attention.uses_native() == native
            return outputs

    assert run(True) == run(False)


def test_without_a_compiler_kvchat_keeps_sdpa_and_says_why(monkeypatch, tiny_llama_dir) -> None:
    monkeypatch.setattr(native_build._State, "detail", native_build._State.detail)
    monkeypatch.setattr(native_build, "_compiler", lambda: None)
    monkeypatch.setattr(native_build._State, "loaded", False)
    monkeypatch.setattr(native_build._State, "building", None)
    native_build.request(wait=True)
    status = native_build.status()
    assert not status.loaded and "no C++ compiler" in status.detail
    assert "torch SDPA" in native_build.summary(torch.device("cpu"))  # the start-up line
    model = load_model(str(tiny_llama_dir), dtype="float32", device="cpu")
    with small_engine(model) as engine:
        c = Collector()
        engine.submit(GenerationRequest((5, 6, 7), max_tokens=4, ignore_eos=True), c)
        assert len(c.wait().generated_ids) == 4
        assert not engine.attention.uses_native()


def test_the_kernel_can_be_turned_off(monkeypatch) -> None:
    monkeypatch.setattr(native_build._State, "detail", native_build._State.detail)
    monkeypatch.setenv(native_build.DISABLE_ENV, "0")
    monkeypatch.setattr(native_build._State, "loaded", False)
    monkeypatch.setattr(native_build._State, "building", None)
    native_build.request(wait=True)
    assert not native_build.loaded()
    assert "turned off" in native_build.status().detail


@pytest.mark.usefixtures("kernel")
def test_the_start_up_line_names_the_attention_in_use() -> None:
    isa = torch.ops.kvchat.quantized_matmul_isa()
    assert isa in ("avx512", "avx2", "portable")
    assert native_build.summary(torch.device("cpu")) == f"kvchat's CPU kernels ({isa})"
    assert native_build.summary(torch.device("cuda")) == "torch SDPA"


@pytest.mark.parametrize(
    ("flags", "dtype", "quantized", "expected"),
    [
        ({"avx512f", "avx512_bf16"}, torch.bfloat16, False, True),  # AMD EPYC: the kernel
        ({"avx512f", "avx512_bf16", "amx_bf16"}, torch.bfloat16, False, False),  # AMX: flash
        ({"avx512f"}, torch.bfloat16, False, False),  # no bf16 pair products
        ({"avx512f", "avx512_bf16"}, torch.float32, False, False),
        ({"avx512f", "avx512_bf16"}, torch.bfloat16, True, False),  # int8 K/V
    ],
)
def test_prefill_chunks_go_to_the_kernel_only_where_it_was_measured_faster(
    monkeypatch, flags, dtype, quantized, expected
) -> None:
    monkeypatch.setattr(native_build, "cpu_flags", lambda: frozenset(flags))
    assert native_attention.serves_chunks(dtype, quantized) is expected


def test_the_decode_loop_streams_one_row_on_amd_and_four_elsewhere(monkeypatch) -> None:
    """The choice reaches the compiler (and so the build's cache key)."""
    assert native_build.stream_rows("AuthenticAMD") == 1
    assert native_build.stream_rows("GenuineIntel") == native_build.stream_rows("") == 4
    for vendor, rows in (("AuthenticAMD", 1), ("GenuineIntel", 4)):
        monkeypatch.setattr(native_build, "cpu_vendor", lambda vendor=vendor: vendor)
        flags = native_build._compile_flags(native_build.Path(torch.__file__).parent)
        assert f"-DKVCHAT_STREAM_ROWS={rows}" in flags


def test_cpu_flags_come_from_the_cpuinfo_line(monkeypatch) -> None:
    monkeypatch.setattr(native_build, "_cpu_signature", lambda: "flags\t\t: fpu avx512_bf16 sse\n")
    assert native_build.cpu_flags() == {"fpu", "avx512_bf16", "sse"}
