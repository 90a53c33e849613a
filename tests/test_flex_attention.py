"""FlexAttention over the paged store, on the CPU: the code and masks a GPU runs.

Every case is compared with `PagedAttention` without kvchat's kernel (torch SDPA over
the gathered pages), with attention written out directly, with the native kernel's
engine and with transformers. All the tiny cases share one store geometry, so the
compiled graphs (one for decode steps, one for steps with prefill chunks, per dtype)
are compiled once per test session.
"""

from __future__ import annotations

from itertools import pairwise

import pytest
import torch
import torch._dynamo.utils

# loaded mid-session, transformers' Llama would register types that invalidate compiled graphs
from transformers import LlamaForCausalLM  # noqa: F401

from kvchat.engine.attention import attention_choice
from kvchat.engine.attention.attention_choice import resolve_attention
from kvchat.engine.attention.flex_attention import FlexPagedAttention
from kvchat.engine.attention.paged_attention import PagedAttention
from kvchat.engine.request import GenerationRequest
from kvchat.engine.tiers.kv_store import DeviceKVStore
from kvchat.errors import UsageError
from kvchat.model.batch import ForwardBatch
from kvchat.model.loader import load_model
from tests.engine_helpers import Collector, small_engine
from tests.parity_helpers import random_ids
from tests.tiny_models import write_tiny_model

# the tiny models' attention: 4 query heads over 2 kv heads of 16
LAYERS, PAGES, PAGE, HKV, GROUP, D = 2, 64, 16, 2, 2, 16
TINY_CACHE = PAGES * PAGE * 2 * LAYERS * HKV * D * 4  # bytes of 64 float32 pages


@pytest.fixture(autouse=True, scope="module")
def _compile_fails_loudly():
    """This module compiles several geometries and dtypes in one process (a user's process
    compiles one): room for them, and an error rather than FlexAttention's silent uncompiled
    fallback, which scores every slot of the store, should a test pass the limit."""
    import torch._dynamo.config as dynamo

    saved = dynamo.recompile_limit, dynamo.fail_on_recompile_limit_hit
    dynamo.recompile_limit, dynamo.fail_on_recompile_limit_hit = 16, True
    yield
    dynamo.recompile_limit, dynamo.fail_on_recompile_limit_hit = saved


def compiled_graphs() -> int:
    """Graphs torch.compile has built in this process (each a compile)."""
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def random_store(dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (LAYERS, PAGES, PAGE, HKV, D)
    return torch.randn(shape, generator=g).to(dtype), torch.randn(shape, generator=g).to(dtype)


def run_both(runs, starts, page_lists, dtype=torch.float32, seed=0, window=None, sinks=False):
    """One forward's attention, every layer, through flex and through SDPA: (flex, sdpa,
    the flex store after, the sdpa store after). With a `window`, the first layer attends
    within it and the second to the whole context (as Gemma 3's and gpt-oss's layers mix);
    with `sinks`, every layer has a random sink logit per query head (gpt-oss's)."""
    k_all, v_all = random_store(dtype, seed)
    batch = ForwardBatch.from_runs(runs, starts)
    g = torch.Generator().manual_seed(seed + 1)
    T = batch.num_tokens
    q = torch.randn(T, HKV * GROUP, D, generator=g).to(dtype)
    k = torch.randn(T, HKV, D, generator=g).to(dtype)
    v = torch.randn(T, HKV, D, generator=g).to(dtype)
    sink_logits = 2 * torch.randn(HKV * GROUP, generator=g).to(dtype) if sinks else None
    per_layer = [dict(window=window, sinks=sink_logits), dict(sinks=sink_logits)]
    flex = FlexPagedAttention(k_all.clone(), v_all.clone())
    sdpa = PagedAttention(k_all.clone(), v_all.clone())
    sdpa.native_enabled = False
    native = PagedAttention(k_all.clone(), v_all.clone())  # kvchat's CPU kernel, once built
    outs = []
    for attention in (flex, sdpa, native):
        attention.prepare(batch, page_lists)
        outs.append(torch.stack([attention(i, q, k, v, **per_layer[i]) for i in range(LAYERS)]))
    if native.uses_native():
        tol = 1e-5 if dtype == torch.float32 else 2e-2
        assert torch.allclose(outs[0].float(), outs[2].float(), atol=tol, rtol=tol)
    return outs[0], outs[1], flex, sdpa


CASES = {
    "one decode": ([[1]], [40], [[5, 3, 9, 1]]),
    "decodes of mixed lengths in scattered pages": (
        [[1], [2], [3], [4], [5]],
        [40, 10, 47, 0, 15],
        [[5, 3, 9, 1], [7, 2], [11, 30, 13, 12], [8], [63, 62]],
    ),
    "a chunk after a cached prefix, mid-page": ([[1] * 20], [37], [[5, 3, 9, 1, 4]]),
    "a chunk after a prefix of whole pages": ([[1] * 32], [32], [[44, 2, 17, 18]]),
    "a first chunk from position 0": ([[1] * 50], [0], [[6, 5, 4, 20]]),
    "chunks of mixed lengths beside decodes": (
        [[1] * 50, [2], [3] * 5, [4] * 17],
        [0, 10, 17, 60],
        [[5, 3, 9, 1], [7, 2], [11, 12], [30, 31, 40, 41, 42]],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_flex_equals_sdpa_and_the_native_kernel_over_the_same_pages(case) -> None:
    runs, starts, page_lists = CASES[case]
    flex, sdpa, flex_store, sdpa_store = run_both(runs, starts, page_lists)
    assert torch.allclose(flex, sdpa, atol=1e-5, rtol=1e-5), (flex - sdpa).abs().max()
    # the new tokens were stored at the same slots
    assert torch.equal(flex_store.k_all, sdpa_store.k_all)
    assert torch.equal(flex_store.v_all, sdpa_store.v_all)


def test_flex_in_bfloat16_is_within_its_rounding_of_sdpa() -> None:
    runs, starts, page_lists = CASES["chunks of mixed lengths beside decodes"]
    flex, sdpa, _, _ = run_both(runs, starts, page_lists, dtype=torch.bfloat16, seed=3)
    assert torch.allclose(flex.float(), sdpa.float(), atol=2e-2, rtol=2e-2)


WINDOWS = (5, 20)  # within one page, across two: neither a multiple of the page size


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("case", list(CASES))
def test_a_windowed_layer_equals_sdpa_and_the_native_kernel(case, window) -> None:
    """Each case's contexts outgrow the window (some sequences' do, beside others that fit
    it): decodes, chunks after a prefix, first chunks longer than the window."""
    runs, starts, page_lists = CASES[case]
    flex, sdpa, flex_store, sdpa_store = run_both(runs, starts, page_lists, window=window)
    assert torch.allclose(flex, sdpa, atol=1e-5, rtol=1e-5), (flex - sdpa).abs().max()
    assert torch.equal(flex_store.k_all, sdpa_store.k_all)


@pytest.mark.parametrize("case", list(CASES))
def test_sinks_equal_sdpa_and_the_native_kernel(case) -> None:
    """A sink logit per query head in every layer's softmax, the first layer windowed. On
    a CPU torch's FlexAttention computes them uncompiled (its compiled CPU kernel returns
    no log-sum-exp), with the same blocks, mask and rescaling a GPU's compiled one gets."""
    runs, starts, page_lists = CASES[case]
    flex, sdpa, _, _ = run_both(runs, starts, page_lists, window=20, sinks=True)
    assert torch.allclose(flex, sdpa, atol=1e-5, rtol=1e-5), (flex - sdpa).abs().max()


def test_a_window_and_sinks_in_bfloat16_are_within_its_rounding_of_sdpa() -> None:
    runs, starts, page_lists = CASES["chunks of mixed lengths beside decodes"]
    for window, sinks in ((20, False), (5, True)):
        flex, sdpa, _, _ = run_both(
            runs, starts, page_lists, dtype=torch.bfloat16, seed=3, window=window, sinks=sinks
        )
        assert torch.allclose(flex.float(), sdpa.float(), atol=2e-2, rtol=2e-2)


def test_sinks_change_the_output() -> None:
    """The sinks case above is not passing by accident: without them flex's output differs."""
    runs, starts, page_lists = CASES["a chunk after a cached prefix, mid-page"]
    with_sinks, _, _, _ = run_both(runs, starts, page_lists, sinks=True)
    without, _, _, _ = run_both(runs, starts, page_lists)
    assert (with_sinks - without).abs().max() > 1e-2


def test_a_windowed_decode_reads_only_the_pages_its_window_reaches() -> None:
    """A decode's blocks in a window of 21 list the pages of its last 21 positions and no
    other; they are rebuilt only when the window's start moves to another page (or to a
    page's first slot, which makes that page whole) or the context spills into a new page."""
    flex = FlexPagedAttention(*random_store(torch.float32, 0))
    pages = [20 + j for j in range(8)]  # logical page j at physical page 20 + j
    window, keys = 21, []
    for total in range(80, 128):
        flex.prepare(ForwardBatch.from_runs([[1]], [total - 1]), [pages])
        mask = flex.block_mask(window)
        partial = mask.kv_indices[0, 0, 0, : mask.kv_num_blocks[0, 0, 0]].tolist()
        full = mask.full_kv_indices[0, 0, 0, : mask.full_kv_num_blocks[0, 0, 0]].tolist()
        reached = {20 + p // PAGE for p in range(total - window, total)}
        assert sorted(partial + full) == sorted(reached), total
        first = total - window
        keys.append((first // PAGE, first % PAGE == 0, (total + PAGE - 1) // PAGE))
    changes = sum(a != b for a, b in pairwise(keys))
    assert flex.blocks_built == 1 + changes < len(keys) // 2


def test_the_uncompiled_fallback_gives_the_same_result(monkeypatch) -> None:
    """Past torch's recompile limit FlexAttention runs uncompiled, reading every page of the
    store through the mask: the mask alone must keep other sequences' pages, and the
    positions before a window, out."""
    from kvchat.engine.attention import flex_attention

    runs, starts, page_lists = CASES["chunks of mixed lengths beside decodes"]
    for window, sinks in ((None, False), (20, True)):
        compiled, sdpa, _, _ = run_both(runs, starts, page_lists, window=window, sinks=sinks)
        with monkeypatch.context() as patch:
            patch.setattr(flex_attention, "_compiled_flex", lambda: flex_attention.flex_attention)
            eager, _, _, _ = run_both(runs, starts, page_lists, window=window, sinks=sinks)
        assert torch.allclose(eager, sdpa, atol=1e-5, rtol=1e-5)
        assert torch.allclose(eager, compiled, atol=1e-5, rtol=1e-5)


def test_flex_equals_attention_written_out() -> None:
    """A chunk of 5 tokens after 37 cached ones in scattered pages, against softmax(qk)v
    over the context gathered by hand: causal, grouped heads, the right pages."""
    pages = [9, 2, 30]
    flex, _, store, _ = run_both([[1] * 5], [37], [pages])
    k_flat = store.k_all[0, pages].reshape(-1, HKV, D)[:42]  # positions 0..41
    v_flat = store.v_all[0, pages].reshape(-1, HKV, D)[:42]
    g = torch.Generator().manual_seed(1)
    q = torch.randn(5, HKV * GROUP, D, generator=g)
    keys = k_flat.repeat_interleave(GROUP, dim=1)  # [42, Hq, D]
    values = v_flat.repeat_interleave(GROUP, dim=1)
    scores = torch.einsum("thd,lhd->htl", q, keys) / D**0.5
    causal = torch.arange(42)[None, :] <= (37 + torch.arange(5))[:, None]  # [5, 42]
    weights = scores.masked_fill(~causal, float("-inf")).softmax(-1)
    expected = torch.einsum("htl,lhd->thd", weights, values)
    assert torch.allclose(flex[0], expected, atol=1e-5, rtol=1e-5)


def test_decode_steps_reuse_their_blocks_until_a_page_fills() -> None:
    k_all, v_all = random_store(torch.float32, 0)
    flex = FlexPagedAttention(k_all, v_all)
    pages = [[3, 4, 5, 6], [8, 9, 10]]
    built = []
    for step in range(20):  # contexts 30..49 and 17..36
        batch = ForwardBatch.from_runs([[1], [2]], [29 + step, 16 + step])
        flex.prepare(batch, pages)
        flex.block_mask()  # what the step's first layer builds or reuses
        built.append(flex.blocks_built)
    # built at the first step, then only when a sequence's context spills into a new
    # page: the first at 33 tokens (step 3) and 49 (step 19), the second at 33 (step 16)
    assert built == [1] * 3 + [2] * 13 + [3] * 3 + [4]


def test_mixed_batch_sizes_and_chunk_lengths_compile_a_bounded_number_of_graphs() -> None:
    """A switch-style run: chunks of every length from 1 to 200 tokens, batches of 1 to 9
    sequences, layers with and without a window (of a different size each step). Past
    torch's recompile limit FlexAttention would silently run uncompiled."""
    k_all, v_all = random_store(torch.float32, 0)
    flex = FlexPagedAttention(k_all, v_all)
    q = torch.randn(300, HKV * GROUP, D)
    k = torch.randn(300, HKV, D)
    before = None
    for i, n in enumerate([1, 7, 16, 17, 33, 64, 100, 150, 200, 3, 1, 45]):
        b = 1 + i % 9
        runs = [[1] * n] + [[2]] * (b - 1)
        starts = [0] + [j for j in range(1, b)]  # one page each
        page_lists = [list(range(13))] + [[20 + j] for j in range(1, b)]
        batch = ForwardBatch.from_runs(runs, starts)
        flex.prepare(batch, page_lists)
        args = (q[: batch.num_tokens], k[: batch.num_tokens], k[: batch.num_tokens])
        flex(0, *args)
        full = compiled_graphs()
        flex(1, *args, window=5 + i)  # every window size runs the graph of full attention
        assert compiled_graphs() == full
        if before is None:
            before = compiled_graphs()  # the first step may compile (once a session)
    assert compiled_graphs() - before <= 1  # at most the other of decode/chunk graphs


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    return load_model(str(tiny_llama_dir), dtype="float32", device="cpu")


def flex_engine(model, **overrides):
    return small_engine(
        model, attention="flex", device_cache_bytes=TINY_CACHE, host_cache_bytes=0, **overrides
    )


def greedy(engine, prompts, max_tokens: int) -> list[tuple[int, ...]]:
    collectors = [Collector() for _ in prompts]
    for prompt, c in zip(prompts, collectors, strict=True):
        engine.submit(GenerationRequest(tuple(prompt), max_tokens=max_tokens, ignore_eos=True), c)
    return [c.wait().generated_ids for c in collectors]


def test_two_hundred_decode_steps_compile_nothing_new(tiny) -> None:
    assert tiny.config.head_dim == D and tiny.config.num_kv_heads == HKV
    with flex_engine(tiny) as engine:
        assert engine.attention_kind == "flex"
        greedy(engine, [[5, 6, 7]], 3)  # the first decode and chunk steps compile (once)
        before = compiled_graphs()
        outputs = greedy(engine, [[3 + i % 90 for i in range(n)] for n in (5, 40, 77)], 200)
    assert [len(o) for o in outputs] == [200, 200, 200]
    assert compiled_graphs() == before


def test_engine_with_flex_matches_the_native_engine_in_float32(tiny) -> None:
    """Batches of mixed lengths, chunked prefill (a 24-token step budget), then a prompt
    that extends the first one: its prefix comes from the cache."""
    prompts = [[3 + (i * 7 + j) % 90 for j in range(10 + 13 * i)] for i in range(4)]

    def run(attention: str) -> list:
        overrides = dict(attention=attention, step_token_budget=24)
        with small_engine(
            tiny, device_cache_bytes=TINY_CACHE, host_cache_bytes=0, **overrides
        ) as engine:
            first = greedy(engine, prompts, 30)
            follow_up = list(prompts[0]) + list(first[0]) + [11, 12, 13]
            return [*first, *greedy(engine, [follow_up], 20)]

    assert run("flex") == run("native")


def test_a_windowed_models_greedy_output_with_flex_equals_native_in_float32(tmp_path) -> None:
    """Gemma 3 (five windowed layers of six, windows of 16 tokens): prompts inside and
    beyond the window decoding side by side after chunked prefill, then a follow-up whose
    prefix comes from the cache. The store has the tiny cases' 64 pages (their graphs)."""
    model = load_model(str(write_tiny_model(tmp_path, "gemma3_text")), dtype="float32",
                       device="cpu")  # fmt: skip
    layers = model.config.num_layers
    prompts = [random_ids(n, seed=n, low=3).tolist() for n in (9, 30, 61)]

    def run(attention: str) -> list:
        with small_engine(
            model,
            attention=attention,
            step_token_budget=24,
            device_cache_bytes=TINY_CACHE // LAYERS * layers,
            host_cache_bytes=0,
        ) as engine:
            first = greedy(engine, prompts, 30)
            follow_up = [*prompts[1], *first[1], 11, 12, 13]
            return [*first, *greedy(engine, [follow_up], 20)]

    assert run("flex") == run("native")


def test_sinks_are_computed_by_flex_on_cuda_and_refused_on_a_cpu_naming_what_runs() -> None:
    assert resolve_attention("flex", torch.device("cuda"), sinks=True) == "flex"
    assert resolve_attention(None, torch.device("cuda"), sinks=True) == "flex"
    with pytest.raises(UsageError, match="--attention native"):
        resolve_attention("flex", torch.device("cpu"), sinks=True)


def test_flex_logits_match_transformers(tiny, tiny_llama_dir) -> None:
    """Prefill in chunks (the second after a cached prefix), then decodes: each step's
    logits against transformers' on the whole sequence, float32."""
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32)
    ids = [3 + (i * 11) % 200 for i in range(45)]
    c = tiny.config
    store = DeviceKVStore(c.num_layers, PAGES, PAGE, c.num_kv_heads, c.head_dim, torch.float32,
                          "cpu")  # fmt: skip
    attention = attention_choice.make_attention(store, "flex")
    pages = [17, 3, 40, 8]  # scattered
    steps = [(0, 30), (30, 12), (42, 1), (43, 1), (44, 1)]
    for start, n in steps:
        batch = ForwardBatch.from_runs([ids[start : start + n]], [start])
        attention.prepare(batch, [pages])
        logits = tiny.transformer.forward(batch, attention)[0]
        with torch.no_grad():
            want = reference(torch.tensor([ids[: start + n]])).logits[0, -1].float()
        error = float((logits - want).norm() / want.norm())
        assert error < 1e-4, (start, n, error)


def test_int8_kv_is_refused_with_what_to_use(tiny) -> None:
    with pytest.raises(UsageError, match="--kv native"):
        resolve_attention("flex", torch.device("cpu"), "int8")
    with pytest.raises(UsageError, match="--kv native"):
        flex_engine(tiny, kv_format="int8")


def test_native_is_refused_on_cuda_naming_the_alternative() -> None:
    with pytest.raises(UsageError, match="--attention flex"):
        resolve_attention("native", torch.device("cuda"))
    assert resolve_attention(None, torch.device("cuda")) == "flex"
    assert resolve_attention(None, torch.device("cpu")) == "native"
    assert resolve_attention("sdpa", torch.device("cuda")) == "sdpa"


@pytest.mark.real_model
def test_default_model_greedy_output_is_identical_with_flex(default_gguf_path) -> None:
    """float32, two prompts decoding side by side, then a follow-up whose prefix is cached."""
    model = load_model(str(default_gguf_path), dtype="float32", device="cpu", weights="bf16")
    messages = ["What is the capital of France?", "Name three colors of the rainbow."]
    prompts = [model.renderer.prompt_ids([{"role": "user", "content": m}]) for m in messages]

    def run(attention: str) -> list:
        with small_engine(model, attention=attention, device_cache_bytes=48 << 20) as engine:
            first = greedy(engine, prompts, 24)
            follow_up = [*prompts[0], *first[0], *prompts[1][-8:]]
            return [*first, *greedy(engine, [follow_up], 16)]

    assert run("flex") == run("native")


@pytest.mark.parametrize(
    ("flags", "says"),
    [
        (["--attention", "flex", "--kv", "int8"], "--kv native"),
        # on a CPU-only torch the device itself is refused first, and says so
        (
            ["--attention", "native", "--device", "cuda"],
            "--attention flex" if torch.cuda.is_available() else "CPU-only build",
        ),
    ],
)
def test_the_command_line_refuses_what_cannot_run_before_loading_a_model(
    capsys, flags, says
) -> None:
    """Exit 2 with what to use instead; the model (which does not exist) is never loaded."""
    from kvchat.cli import main

    assert main(["ask", "--model", "/nonexistent/model.gguf", *flags, "hi"]) == 2
    assert says in capsys.readouterr().err


def test_kvchats_cpu_attention_is_refused_on_cuda_naming_what_runs_there() -> None:
    from kvchat.engine.attention.attention_choice import resolve_attention
    from kvchat.errors import KvchatError

    with pytest.raises(KvchatError, match="--attention flex"):
        resolve_attention("native", torch.device("cuda"), "native")


def test_the_settings_key_chooses_the_attention_and_the_flag_overrides_it() -> None:
    from kvchat.chat.settings import load_settings
    from kvchat.cli import build_parser
    from kvchat.errors import KvchatError
    from kvchat.paths import app_paths
    from kvchat.runtime import resolve_options

    path = app_paths().settings_file
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text('attention = "sdpa"\n')
    parser = build_parser()
    assert resolve_options(parser.parse_args(["ask", "q"]), load_settings()).attention == "sdpa"
    args = parser.parse_args(["ask", "--attention", "flex", "q"])
    assert resolve_options(args, load_settings()).attention == "flex"
    path.write_text('attention = "fast"\n')
    with pytest.raises(KvchatError, match="attention"):
        load_settings()
