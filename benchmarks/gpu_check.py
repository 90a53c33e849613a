"""kvchat on a GPU, checked in one run: parity, the engine, compiles, and a small bench.

Run by `benchmarks/gpu_check.sh` on a machine with a GPU, its own torch and no network;
`--dry-run` runs every check on the CPU at tiny sizes (how it is tested where no GPU is).
Models are random-weight Llama folders written here (the default model's attention
geometry: 9 query heads over 3 kv heads of 64; the bench model has the default model's
whole shape), since no model file travels with the check. It prints one summary:
a line per check (PASS/FAIL and its figures), then the same as JSON.

Checks:
- ops: FlexAttention vs torch SDPA over the same paged store (decodes of mixed lengths,
  chunks after cached prefixes, scattered pages), float32 and bfloat16.
- logits: a random model's logits at each step of a chunked prefill and decodes, flex vs
  SDPA (and vs transformers, when it is installed), float32 and bfloat16.
- engine: greedy generation through the engine, flex vs SDPA, float32, batches of mixed
  lengths in small chunks.
- host tier: a device cache too small for three conversations, so pages go to the host
  tier (pinned, side-stream copies) and come back; the reply equals one never evicted.
- compiles: no compile during 200 decode steps after warm-up; the graphs built overall.
- bench: prefill and decode tokens/s of the default model's shape, bf16, flex vs SDPA.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import threading
import time
import traceback
from pathlib import Path

import torch

DEFAULT_SHAPE = dict(  # SmolLM2-135M
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    vocab_size=49152,
)


class Check:
    def __init__(self) -> None:
        self.results: list[dict] = []

    def run(self, name: str, fn, *args) -> None:
        started = time.perf_counter()
        try:
            ok, figures = fn(*args)
        except Exception as exc:  # a check that breaks is a failed check, and the rest run
            ok, figures = False, {"error": f"{type(exc).__name__}: {exc}"}
            traceback.print_exc()
        figures["seconds"] = round(time.perf_counter() - started, 1)
        self.results.append({"check": name, "ok": bool(ok), **figures})
        print(f"[{'PASS' if ok else 'FAIL'}] {name}: {figures}", flush=True)


SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


def write_tokenizer(folder: Path, vocab_size: int) -> None:
    """A word-level tokenizer with one token per id of the model (`t3`, `t4`, ...), so any
    id a random model generates decodes; the chat specials at 0-2, end of turn at 2."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    vocab |= {f"t{i}": i for i in range(len(SPECIAL_TOKENS), vocab_size)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token=SPECIAL_TOKENS[0]))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {
        "bos_token": SPECIAL_TOKENS[1],
        "eos_token": SPECIAL_TOKENS[2],
        "add_bos_token": False,
        "chat_template": "{% for m in messages %}{{ m['content'] }} {% endfor %}",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config))


def write_model(folder: Path, shape: dict, seed: int) -> Path:
    """A random-weight Llama folder (config, safetensors, a tokenizer of its vocabulary)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    h, inter, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    heads, kv_heads, vocab = (
        shape["num_attention_heads"],
        shape["num_key_value_heads"],
        shape["vocab_size"],
    )
    d = h // heads
    config = dict(
        model_type="llama",
        architectures=["LlamaForCausalLM"],
        hidden_size=h,
        intermediate_size=inter,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=vocab,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        bos_token_id=1,
        eos_token_id=2,
    )
    g = torch.Generator().manual_seed(seed)

    def mat(rows: int, cols: int) -> torch.Tensor:
        # scaled up from the usual 0.02 so the logits of different tokens differ clearly
        return torch.randn(rows, cols, generator=g) * (2.0 / cols**0.5)

    weights = {"model.embed_tokens.weight": mat(vocab, h), "model.norm.weight": torch.ones(h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        weights |= {
            p + "input_layernorm.weight": torch.ones(h),
            p + "post_attention_layernorm.weight": torch.ones(h),
            p + "self_attn.q_proj.weight": mat(heads * d, h),
            p + "self_attn.k_proj.weight": mat(kv_heads * d, h),
            p + "self_attn.v_proj.weight": mat(kv_heads * d, h),
            p + "self_attn.o_proj.weight": mat(h, heads * d),
            p + "mlp.gate_proj.weight": mat(inter, h),
            p + "mlp.up_proj.weight": mat(inter, h),
            p + "mlp.down_proj.weight": mat(h, inter),
        }
    save_file({k: v.contiguous() for k, v in weights.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config))
    write_tokenizer(folder, vocab)
    return folder


class Setup:
    """Sizes for a GPU run or a CPU dry run; one store geometry throughout, so the
    compiled graphs are one per dtype and kind of step."""

    def __init__(self, dry_run: bool, device: torch.device) -> None:
        self.device = device
        self.dry_run = dry_run
        self.page = 16 if dry_run else 256
        self.pages = 64
        if dry_run:
            self.shape = dict(
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                vocab_size=384,
            )
            self.bench_shape = self.shape
        else:
            self.shape = {**DEFAULT_SHAPE, "num_hidden_layers": 2, "vocab_size": 384}
            self.bench_shape = DEFAULT_SHAPE
        self.kv_heads = self.shape["num_key_value_heads"]
        self.group = self.shape["num_attention_heads"] // self.kv_heads
        self.head_dim = self.shape["hidden_size"] // self.shape["num_attention_heads"]

    def cache_bytes(self, model, pages: int | None = None) -> int:
        from kvchat.engine.tiers.kv_store import kv_bytes_per_token

        c = model.config
        per_token = kv_bytes_per_token(c.num_layers, c.num_kv_heads, c.head_dim, model.dtype)
        return (pages or self.pages) * self.page * per_token


def check_environment(setup: Setup):
    import kvchat

    figures = {"torch": torch.__version__, "kvchat": str(Path(kvchat.__file__).parent)}
    try:
        import triton

        figures["triton"] = triton.__version__
    except ImportError:
        figures["triton"] = None
    if setup.device.type == "cuda":
        figures["gpu"] = torch.cuda.get_device_name(setup.device)
        figures["cuda"] = torch.version.cuda
        figures["bf16"] = torch.cuda.is_bf16_supported()
    return setup.device.type == "cuda" or setup.dry_run, figures


def check_ops(setup: Setup):
    from kvchat.engine.attention.flex_attention import FlexPagedAttention
    from kvchat.engine.attention.paged_attention import PagedAttention
    from kvchat.model.batch import ForwardBatch

    S, P = setup.page, setup.pages
    cases = [  # (runs' lengths, start positions, page lists)
        ([1, 1, 1, 1], [3 * S + 5, S - 1, 4 * S, 0], [[9, 3, 60, 1], [7], [11, 2, 5, 6, 40], [8]]),
        ([S + 7], [2 * S + 3], [[5, 3, 9, 1, 4]]),
        (
            [3 * S, 1, 5, S // 2],
            [0, 9, 2 * S - 3, 4 * S],
            [[6, 4, 2], [7], [11, 12, 50], [30, 31, 40, 41, 42]],
        ),
    ]
    worst: dict[str, float] = {}
    ok = True
    for dtype, tol in ((torch.float32, 2e-3), (torch.bfloat16, 3e-2)):
        g = torch.Generator().manual_seed(0)
        shape = (2, P, S, setup.kv_heads, setup.head_dim)
        k_all = torch.randn(shape, generator=g).to(dtype).to(setup.device)
        v_all = torch.randn(shape, generator=g).to(dtype).to(setup.device)
        for lens, starts, pages in cases:
            batch = ForwardBatch.from_runs([[1] * n for n in lens], starts, device=setup.device)
            T = batch.num_tokens
            q, k, v = (
                torch.randn(T, h, setup.head_dim, generator=g).to(dtype).to(setup.device)
                for h in (setup.kv_heads * setup.group, setup.kv_heads, setup.kv_heads)
            )
            flex = FlexPagedAttention(k_all.clone(), v_all.clone())
            sdpa = PagedAttention(k_all.clone(), v_all.clone())
            sdpa.native_enabled = False
            outs = []
            for attention in (flex, sdpa):
                attention.prepare(batch, pages)
                outs.append(torch.stack([attention(i, q, k, v) for i in range(2)]).float())
            error = float((outs[0] - outs[1]).abs().max())
            name = str(dtype).removeprefix("torch.")
            worst[name] = max(worst.get(name, 0.0), error)
            ok &= error < tol
    return ok, {"max_abs_error": worst}


def check_logits(setup: Setup, folder: Path):
    from kvchat.engine.attention.attention_choice import make_attention
    from kvchat.engine.tiers.kv_store import DeviceKVStore
    from kvchat.model.batch import ForwardBatch
    from kvchat.model.loader import load_model

    S = setup.page
    ids = [3 + (i * 11) % 300 for i in range(2 * S + 9)]
    steps = [(0, S + 5), (S + 5, S), (2 * S + 5, 1), (2 * S + 6, 1), (2 * S + 7, 1)]
    pages = [17, 3, 40, 8]
    figures: dict = {}
    ok = True
    reference = None
    try:
        from transformers import AutoModelForCausalLM

        reference = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
        reference = reference.to(setup.device)
    except Exception as exc:  # transformers is optional on the GPU machine
        figures["transformers"] = f"not compared ({type(exc).__name__})"
    for dtype, tol in (("float32", 1e-3), ("bfloat16", 5e-2)):
        model = load_model(str(folder), dtype=dtype, device=str(setup.device))
        c = model.config
        logits = {}
        for kind in ("flex", "sdpa"):
            store = DeviceKVStore(
                c.num_layers, setup.pages, S, c.num_kv_heads, c.head_dim, model.dtype, setup.device
            )
            attention = make_attention(store, kind)
            rows = []
            for start, n in steps:
                batch = ForwardBatch.from_runs([ids[start : start + n]], [start], setup.device)
                attention.prepare(batch, [pages])
                rows.append(model.transformer.forward(batch, attention)[0])
            logits[kind] = torch.stack(rows)
        error = float((logits["flex"] - logits["sdpa"]).norm() / logits["sdpa"].norm())
        figures[f"{dtype}_vs_sdpa"] = error
        ok &= error < tol
        if reference is not None:
            with torch.no_grad():
                want = torch.stack(
                    [
                        reference(torch.tensor([ids[: s + n]], device=setup.device)).logits[0, -1]
                        for s, n in steps
                    ]
                ).float()
            error = float((logits["flex"] - want).norm() / want.norm())
            figures[f"{dtype}_vs_transformers_fp32"] = error
            ok &= error < (1e-3 if dtype == "float32" else 5e-2)
    return ok, figures


class Finished:
    """Waits for one request's RequestFinished."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.event = None

    def __call__(self, event) -> None:
        from kvchat.engine.events import RequestFinished

        if isinstance(event, RequestFinished):
            self.event = event
            self.done.set()

    def ids(self) -> tuple[int, ...]:
        if not self.done.wait(600):
            raise TimeoutError("a request did not finish in 600 s")
        if self.event.error:
            raise RuntimeError(f"the engine failed a request: {self.event.error}")
        return tuple(self.event.generated_ids)


def greedy(engine, prompts, max_tokens: int) -> list[tuple[int, ...]]:
    from kvchat.engine.request import GenerationRequest

    waits = [Finished() for _ in prompts]
    for prompt, wait in zip(prompts, waits, strict=True):
        request = GenerationRequest(tuple(prompt), max_tokens=max_tokens, ignore_eos=True)
        engine.submit(request, wait)
    return [wait.ids() for wait in waits]


def check_engine(setup: Setup, folder: Path):
    from kvchat.engine.config import EngineConfig
    from kvchat.engine.engine import Engine
    from kvchat.model.loader import load_model

    model = load_model(str(folder), dtype="float32", device=str(setup.device))
    prompts = [[3 + (i * 7 + j) % 300 for j in range(10 + 37 * i)] for i in range(4)]
    outputs = {}
    for kind in ("flex", "sdpa"):
        config = EngineConfig(
            page_size=setup.page,
            device_cache_bytes=setup.cache_bytes(model),
            host_cache_bytes=0,
            attention=kind,
            step_token_budget=48,
        )
        with Engine(model, config) as engine:
            outputs[kind] = greedy(engine, prompts, 48)
    pairs = list(zip(outputs["flex"], outputs["sdpa"], strict=True))
    flat = [(a, b) for x, y in pairs for a, b in zip(x, y, strict=True)]
    agree = sum(a == b for a, b in flat) / len(flat)
    first_diverge = [
        next((i for i, (a, b) in enumerate(zip(x, y, strict=True)) if a != b), None)
        for x, y in zip(outputs["flex"], outputs["sdpa"], strict=True)
    ]
    return agree >= 0.9, {"tokens_agree": round(agree, 4), "first_divergence": first_diverge}


def check_host_tier(setup: Setup, folder: Path):
    from kvchat.engine.config import EngineConfig
    from kvchat.engine.engine import Engine
    from kvchat.model.loader import load_model

    model = load_model(str(folder), dtype="float32", device=str(setup.device))
    S = setup.page
    # three conversations of more than a third of the device cache each: the first is
    # evicted to the host tier by the other two, and its follow-up restores it from there
    # (the store keeps the size of every other check's: no new compile)
    length = (setup.pages // 3 + 2) * S
    docs = [[3 + (i * 13 + j * 5) % 300 for j in range(length)] for i in range(3)]
    follow_up = [*docs[0], 7, 8, 9]

    def run(conversations) -> tuple[tuple[int, ...], int, object]:
        config = EngineConfig(
            page_size=S,
            device_cache_bytes=setup.cache_bytes(model),
            host_cache_bytes=setup.cache_bytes(model, 2 * setup.pages),
            attention="flex",
        )
        with Engine(model, config) as engine:
            for doc in conversations:  # one at a time, as a user switching conversations
                greedy(engine, [doc], 4)
            reply = greedy(engine, [follow_up], 16)[0]
            engine.validate_cache()
            stats = engine.stats().cache
            return reply, stats.cached_tokens.host, stats.evictions

    restored, from_host, evictions = run(docs)
    computed, _, _ = run([])  # the follow-up alone, computed from its tokens
    ok = restored == computed and from_host > 0
    return ok, {
        "reply_equal": restored == computed,
        "host_cached_tokens": from_host,
        "evictions": str(evictions),
    }


def check_compiles(setup: Setup, folder: Path):
    import torch._dynamo.utils
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list
    from torch.nn.attention.flex_attention import flex_attention

    from kvchat.engine.config import EngineConfig
    from kvchat.engine.engine import Engine
    from kvchat.model.loader import load_model

    model = load_model(str(folder), dtype="float32", device=str(setup.device))
    config = EngineConfig(
        page_size=setup.page,
        device_cache_bytes=setup.cache_bytes(model),
        host_cache_bytes=0,
        attention="flex",
    )
    counters = torch._dynamo.utils.counters
    with Engine(model, config) as engine:
        greedy(engine, [[5, 6, 7]], 3)
        before = counters["stats"]["unique_graphs"]
        outputs = greedy(engine, [[3 + i % 90 for i in range(n)] for n in (5, 40, 77)], 200)
        during = counters["stats"]["unique_graphs"] - before
    ok = during == 0 and all(len(o) == 200 for o in outputs)
    return ok, {
        "graphs_during_200_decode_steps": during,
        "flex_graphs_in_this_run": len(_debug_get_cache_entry_list(flex_attention.__code__)),
    }


def check_bench(setup: Setup, root: Path):
    from kvchat.engine.attention.attention_choice import make_attention
    from kvchat.engine.config import EngineConfig
    from kvchat.engine.engine import Engine
    from kvchat.engine.tiers.kv_store import DeviceKVStore
    from kvchat.model.batch import ForwardBatch
    from kvchat.model.loader import load_model

    folder = write_model(root / "bench-model", setup.bench_shape, seed=1)
    dtype = "float32" if setup.dry_run else "bfloat16"
    model = load_model(str(folder), dtype=dtype, device=str(setup.device))
    c = model.config
    vocab = c.vocab_size
    S = setup.page
    lengths = (64, 256) if setup.dry_run else (512, 2048)
    decode_tokens = 16 if setup.dry_run else 64
    figures: dict = {"dtype": dtype, "layers": c.num_layers}

    def prompts(step: int, count: int) -> list[list[int]]:
        return [[(step * i + b) % vocab for i in range(lengths[0])] for b in range(count)]

    def sync() -> None:
        if setup.device.type == "cuda":
            torch.cuda.synchronize(setup.device)

    for kind in ("flex", "sdpa"):
        for n in lengths:
            ids = [(7 * i) % vocab for i in range(n)]
            seconds = []
            for _ in range(2):  # the first call of a shape compiles; the second is timed
                store = DeviceKVStore(
                    c.num_layers,
                    setup.pages,
                    S,
                    c.num_kv_heads,
                    c.head_dim,
                    model.dtype,
                    setup.device,
                )
                attention = make_attention(store, kind)
                batch = ForwardBatch.from_runs([ids], [0], device=setup.device)
                attention.prepare(batch, [list(range(setup.pages))])
                sync()
                t0 = time.perf_counter()
                model.transformer.forward(batch, attention)
                sync()
                seconds.append(time.perf_counter() - t0)
            figures[f"{kind}_prefill_{n}_tok_s"] = round(n / seconds[-1])
        for batch_size in (1, 8):
            config = EngineConfig(
                page_size=S,
                device_cache_bytes=setup.cache_bytes(model),
                host_cache_bytes=0,
                attention=kind,
            )
            with Engine(model, config) as engine:
                greedy(engine, prompts(11, batch_size), 4)  # warm-up: compiles, first steps
                seconds = {}
                for step, tokens in ((13, 1), (17, decode_tokens)):  # new prompts: no cache hit
                    t0 = time.perf_counter()
                    greedy(engine, prompts(step, batch_size), tokens)
                    seconds[tokens] = time.perf_counter() - t0
            # the prompts' prefill and first token taken out: decode steps only
            decode_seconds = seconds[decode_tokens] - seconds[1]
            figures[f"{kind}_decode_batch{batch_size}_tok_s"] = round(
                batch_size * (decode_tokens - 1) / decode_seconds, 1
            )
    return True, figures


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="on the CPU, at tiny sizes")
    parser.add_argument("--skip", default="", help="comma-separated checks to leave out")
    args = parser.parse_args()
    if args.dry_run:
        device = torch.device("cpu")
    elif torch.cuda.is_available():
        device = torch.device("cuda")
    else:
        print("gpu_check: no CUDA device here; run with --dry-run to check on the CPU")
        return 2
    # every dtype and kind of step is its own graph, and this run has several
    torch._dynamo.config.recompile_limit = 32
    # now, not mid-run: loading transformers' Llama registers types that invalidate graphs
    with contextlib.suppress(ImportError):
        from transformers import LlamaForCausalLM  # noqa: F401
    setup = Setup(args.dry_run, device)
    skip = set(filter(None, args.skip.split(",")))
    check = Check()
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvchat-gpu-check-") as tmp:
        root = Path(tmp)
        os.environ.setdefault("KVCHAT_HOME", str(root / "home"))
        folder = write_model(root / "model", setup.shape, seed=0)
        plan = [
            ("environment", check_environment, setup),
            ("ops", check_ops, setup),
            ("logits", check_logits, setup, folder),
            ("engine", check_engine, setup, folder),
            ("host_tier", check_host_tier, setup, folder),
            ("compiles", check_compiles, setup, folder),
            ("bench", check_bench, setup, root),
        ]
        for name, fn, *fn_args in plan:
            if name not in skip:
                check.run(name, fn, *fn_args)
    passed = all(r["ok"] for r in check.results)
    total = round(time.perf_counter() - started, 1)
    print("\n=== kvchat gpu_check summary ===")
    for r in check.results:
        figures = {k: v for k, v in r.items() if k not in ("check", "ok")}
        print(f"{'PASS' if r['ok'] else 'FAIL'}  {r['check']:<12} {json.dumps(figures)}")
    print(f"{'ALL PASSED' if passed else 'FAILURES'} in {total} s on {device.type}")
    print(json.dumps({"passed": passed, "seconds": total, "checks": check.results}))
    return 0 if passed else 1


if __name__ == "__main__":
    raise SystemExit(main())
