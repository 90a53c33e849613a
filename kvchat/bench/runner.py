"""`kvchat bench`: load the model and the peers once, run the workloads, write the report.

The command line picks the workloads (`--workloads speed,W1,sweep,W2,W3,W4`), the
peers (`--peers transformers-naive,transformers-cache,llama.cpp`; default: every
one that is installed), the repeats and the output folder. A peer that cannot
run here (package missing, a model that is not a GGUF for llama.cpp) is skipped
with its reason in the report; a peer that fails mid-run loses only its own
numbers. The exit code is 1 only when kvchat itself failed a workload. Each run writes
into a folder of its own under the git-ignored `benchmarks/runs/` unless `--out` says
otherwise; `bench.json` records kvchat's version and commit and the command line
(`provenance.py`).
"""

from __future__ import annotations

import datetime as dt
import shutil
import sys
import tempfile
import time
from pathlib import Path

from kvchat.bench import documents as docs
from kvchat.bench.machine import (
    dense_weight_bytes_per_token,
    machine_info,
    weight_bytes_per_token,
)
from kvchat.bench.peak_memory import own_peak
from kvchat.bench.peers.base import PeerUnavailable
from kvchat.bench.peers.kvchat import KvchatPeer
from kvchat.bench.provenance import (
    command_line,
    default_out,
    git_revision,
    kvchat_version,
    without_folders,
)
from kvchat.bench.report import markdown, write_report
from kvchat.bench.restart_phase import model_load
from kvchat.bench.workloads import WORKLOAD_NAMES, WORKLOADS
from kvchat.bench.workloads.context import DISK_NAME, BenchContext
from kvchat.bench.workloads.plan import make_plan
from kvchat.engine.config import default_cache_bytes
from kvchat.errors import KvchatError, UsageError
from kvchat.model.device import dtype_name
from kvchat.paths import app_paths
from kvchat.units import format_size

DENSE_NAME = "kvchat-dense"
# What the bench keeps its own process under where it chooses: the dense comparison
# model is left out when loading it would pass this (`_dense_too_big`).
PROCESS_MEMORY_BUDGET = 12 * 2**30
PEER_NAMES = (
    "transformers-naive",
    "transformers-cache",
    "llama.cpp",
    "llama-bench",
    "llama-server",
    "llama-server-1slot",
    "vllm",
)
PEER_ALIASES: dict[str, tuple[str, ...]] = {
    "transformers": ("transformers-naive", "transformers-cache"),
    "hf": ("transformers-naive", "transformers-cache"),
    "llama-cpp": ("llama.cpp",),
    "llamacpp": ("llama.cpp",),
    "none": (),
}


def parse_workloads(text: str | None) -> list[str]:
    """`--workloads` as canonical names, in the suite's order; all of them when unset."""
    if not text:
        return list(WORKLOAD_NAMES)
    by_lower = {n.lower(): n for n in WORKLOAD_NAMES}
    picked = set()
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        if part.lower() not in by_lower:
            raise KvchatError(
                f"Unknown workload {part!r} in --workloads; pick from {', '.join(WORKLOAD_NAMES)}."
            )
        picked.add(by_lower[part.lower()])
    return [n for n in WORKLOAD_NAMES if n in picked]


def parse_peers(text: str | None) -> list[str]:
    """`--peers` as canonical names; every peer when unset (missing ones are skipped later)."""
    if text is None:
        return list(PEER_NAMES)
    picked: set[str] = set()
    for part in (p.strip().lower() for p in text.split(",")):
        if not part:
            continue
        if part in PEER_NAMES:
            picked.add(part)
        elif part in PEER_ALIASES:
            picked.update(PEER_ALIASES[part])
        else:
            raise KvchatError(
                f"Unknown peer {part!r} in --peers; pick from {', '.join(PEER_NAMES)} "
                "(or 'transformers' for both transformers peers, 'none' for kvchat alone)."
            )
    return [n for n in PEER_NAMES if n in picked]


def load_peers(
    names: list[str], model, progress, servers: dict[str, str | None] | None = None
) -> tuple[dict, dict, dict[str, str]]:
    """(chat peers, speed peers, skipped name -> reason) for the requested peer names.

    `servers` maps "llama-server" and "vllm" to the paths `--llama-server` and
    `--vllm-python` gave (a serving engine is a peer only where its path is given; both
    llama-server peers run the one binary);
    llama-bench comes from beside that llama-server, else from the servers cache.
    """
    chat: dict[str, object] = {}
    speed: dict[str, object] = {}
    skipped: dict[str, str] = {}
    servers = servers or {}
    for name in ("llama-server", "llama-server-1slot", "vllm"):
        if name in names:
            path = servers.get("llama-server" if name.startswith("llama-server") else name)
            try:
                chat[name] = _serving_peer(name, path, model, progress)
            except PeerUnavailable as exc:
                skipped[name] = str(exc)
    hf_names = [n for n in names if n.startswith("transformers-")]
    if hf_names:
        from kvchat.bench.peers.hf_model import HfModel

        try:
            hf = HfModel(model, progress)
        except PeerUnavailable as exc:
            skipped.update({n: str(exc) for n in hf_names})
        else:
            from kvchat.bench.peers.hf_cache import HfCachePeer
            from kvchat.bench.peers.hf_naive import HfNaivePeer

            speed["transformers"] = hf
            if "transformers-naive" in names:
                chat["transformers-naive"] = HfNaivePeer(hf)
            if "transformers-cache" in names:
                chat["transformers-cache"] = HfCachePeer(hf)
    if "llama.cpp" in names:
        from kvchat.bench.peers.llama_cpp import LlamaCppPeer

        try:
            llama = LlamaCppPeer(model, progress)
        except PeerUnavailable as exc:
            skipped["llama.cpp"] = str(exc)
        else:
            chat["llama.cpp"] = llama
            speed["llama.cpp"] = llama
    if "llama-bench" in names:
        try:
            speed["llama-bench"] = _llama_bench_peer(servers.get("llama-server"), model)
        except PeerUnavailable as exc:
            skipped["llama-bench"] = str(exc)
    return chat, speed, skipped


def _llama_bench_peer(llama_server: str | None, model):
    """llama-bench of the build for this CPU (or the emulated one), on kvchat's own file,
    with kvchat's thread count."""
    import torch

    from kvchat.bench.emulated_cpu import emulated_cpu
    from kvchat.bench.llama_cpp_tools import find_llama_bench
    from kvchat.bench.peers.llama_bench import LlamaBenchPeer
    from kvchat.native.build import cpu_flags

    source = Path(str(model.source))
    if source.suffix.lower() != ".gguf":
        return _raise(f"llama-bench measures GGUF files; the model is not one ({source.name})")
    try:
        binary = find_llama_bench(llama_server, cpu_flags(), emulated_cpu() or "native")
    except KvchatError as exc:
        raise PeerUnavailable(str(exc)) from exc
    return LlamaBenchPeer(binary, source, torch.get_num_threads())


def _serving_peer(name: str, path: str | None, model, progress):
    from kvchat.bench.peers.serving import LlamaServerPeer, OneSlotLlamaServerPeer, VllmPeer

    flag = "--llama-server" if name.startswith("llama-server") else "--vllm-python"
    if not path:
        return _raise(f"give {flag} PATH to measure it (benchmarks/servers/ builds one)")
    source = Path(str(model.source))
    if name == "llama-server":
        return LlamaServerPeer(Path(path), source, progress)
    if name == "llama-server-1slot":
        return OneSlotLlamaServerPeer(Path(path), source, progress)
    folder = source
    if source.suffix.lower() == ".gguf":
        from kvchat.bench.peers.hf_folder import hf_folder_of
        from kvchat.paths import app_paths

        progress(f"Writing a Hugging Face folder of {source.name} for vLLM (once)...")
        folder = hf_folder_of(source, app_paths().models_dir / f"{source.stem}-hf")
    return VllmPeer(Path(path), folder, progress)


def _raise(message: str):
    raise PeerUnavailable(message)


def _load(options, weights: str, progress):
    from kvchat.model.loader import load_model

    return load_model(
        options.model,
        dtype=options.dtype,
        device=options.device,
        weights=weights,
        quantize=options.quantize,
        progress=progress,
    )


def _dense_too_big(dense_bytes: int, device, options) -> str | None:
    """Why the dense-weights comparison is left out, or None when it fits: its weights
    and two engines' caches (its own and kvchat's) beside what the process already took
    must stay under `PROCESS_MEMORY_BUDGET`. A 1B-class model's dense copy beside its
    4-bit one is where this bites; the comparison with llama.cpp is the one wanted there."""
    if device.type != "cpu":  # the weights then live on the GPU, not in this process
        return None
    device_default, host_default = default_cache_bytes(device)
    caches = (options.device_cache or device_default) + (
        host_default if options.host_cache is None else options.host_cache
    )
    need = own_peak() + dense_bytes + 2 * caches
    if need <= PROCESS_MEMORY_BUDGET:
        return None
    return (
        f"its dense weights ({format_size(dense_bytes)}) beside the quantized model would "
        f"take the bench's process to about {format_size(need)}, over the "
        f"{format_size(PROCESS_MEMORY_BUDGET)} it keeps to"
    )


def _kvchat_peer(
    model, options, name: str, weights: str, disk_scratch: Path | None = None
) -> KvchatPeer:
    return KvchatPeer(
        model,
        page_size=options.page_size,
        device_cache_bytes=options.device_cache,
        host_cache_bytes=options.host_cache,
        kv_format=options.kv,
        attention=options.attention,
        name=name,
        weights=weights,
        disk_scratch=disk_scratch,
    )


def _command(args) -> str:
    """The command line as typed (absolute paths cut to their last part), else rebuilt."""
    argv = getattr(args, "argv", None)
    if argv:
        return command_line(argv)
    parts = ["kvchat bench"]
    if args.quick:
        parts.append("--quick")
    flags = (
        "workloads",
        "peers",
        "repeats",
        "model",
        "dtype",
        "device",
        "page_size",
        "weights",
        "quantize",
        "kv",
        "attention",
    )
    for flag in flags:
        value = getattr(args, flag, None)
        if value is not None:
            parts.append(f"--{flag.replace('_', '-')} {without_folders(str(value))}")
    return " ".join(parts)


def _shape_command(args, progress) -> bool:
    """`--list-shapes` and `--remove-shape` (then nothing else runs: True); `--model-shape`
    makes the shape if needed and puts its GGUF in `--model`'s place."""
    from kvchat.bench import model_maker

    cache = app_paths().cache_dir
    if getattr(args, "list_shapes", False):
        made = model_maker.made_shapes(cache)
        for shape in made:
            print(f"{shape.name}\t{format_size(shape.size)}\t{shape.folder}")
        if not made:
            print(f"No shapes made yet (they go to {model_maker.shapes_dir(cache)}).")
        return True
    if getattr(args, "remove_shape", None):
        removed = model_maker.remove_shape(cache, args.remove_shape)
        print(f"Removed {removed.name} ({format_size(removed.size)}, {removed.folder}).")
        return True
    if getattr(args, "model_shape", None):
        if args.model:
            raise UsageError("--model-shape measures a made model in --model's place: give one.")
        from kvchat.model.default_model import ensure_default_gguf

        shape, quant = model_maker.parse_shape(args.model_shape)
        made = model_maker.make_shape(
            shape,
            cache,
            ensure_default_gguf(progress),
            progress,
            llama_server=getattr(args, "llama_server", None),
        )
        args.model = str(made.gguf(quant))
    return False


def main(args) -> int:
    from kvchat.remote.options import remote_options
    from kvchat.runtime import read_settings, resolve_options

    def progress(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    from kvchat.bench.emulated_cpu import restart_emulating

    restart_emulating(getattr(args, "cpu", "native"), getattr(args, "argv", []))
    if _shape_command(args, progress):
        return 0
    workloads = parse_workloads(args.workloads)
    peer_names = parse_peers(args.peers)
    if "speed" not in workloads:  # llama-bench measures speed only
        peer_names = [n for n in peer_names if n != "llama-bench"]
    if args.repeats is not None and args.repeats < 1:
        raise KvchatError("--repeats must be at least 1.")
    if args.temperature:
        progress("kvchat bench: every engine decodes greedily; --temperature is ignored.")
    options = resolve_options(args, read_settings(progress))
    started = time.perf_counter()
    model = _load(options, options.weights, progress)
    plan = make_plan(quick=args.quick, repeats=args.repeats, context_length=model.context_length)
    kvchat = _kvchat_peer(model, options, "kvchat", options.weights)
    variants, dense_left_out = {}, None
    dense = dense_weight_bytes_per_token(model.config, model.dtype)
    if "speed" in workloads and weight_bytes_per_token(model.transformer) < 0.75 * dense:
        dense_left_out = _dense_too_big(dense, model.device, options)
        if dense_left_out is None:
            progress("Loading kvchat with dense weights too, for the same-dtype comparison...")
            dense_model = _load(options, "bf16", progress)
            variants[DENSE_NAME] = _kvchat_peer(dense_model, options, DENSE_NAME, "dense")
    servers = {
        "llama-server": getattr(args, "llama_server", None),
        "vllm": getattr(args, "vllm_python", None),
    }
    chat_peers, speed_peers, skipped = load_peers(peer_names, model, progress, servers)
    if dense_left_out is not None:
        skipped[DENSE_NAME] = dense_left_out
    remote = None
    if getattr(args, "engine", None):  # on the command line only: a settings file's is for chat
        remote = remote_options(args, read_settings(progress))
    if remote is not None:  # kvchat's own sessions on that server, beside the embedded engine
        from kvchat.bench.peers.kvchat_remote import KvchatRemotePeer

        try:
            peer = KvchatRemotePeer(remote, progress)
            chat_peers[peer.name] = peer
        except PeerUnavailable as exc:
            skipped["kvchat@server"] = str(exc)
    for name, why in skipped.items():
        progress(f"kvchat bench: skipping {name}: {why}")
    # disk tiers and saved caches go where kvchat's disk tier lives, not to a RAM-backed /tmp
    cache_dir = app_paths().cache_dir
    cache_dir.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix="bench-scratch-", dir=cache_dir))
    kvchat_disk = None
    if {"sweep", "W2"} & set(workloads):
        kvchat_disk = _kvchat_peer(model, options, DISK_NAME, options.weights, scratch / "kv")
    ctx = BenchContext(
        model,
        plan,
        kvchat,
        chat_peers,
        speed_peers,
        variants,
        kvchat_disk,
        scratch,
        progress,
        model_load=model_load(model, options.weights, options.quantize),
    )
    results: dict = {
        "command": _command(args),
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "kvchat": {"version": kvchat_version(), "git": git_revision()},
        "quick": plan.quick,
        "repeats": plan.repeats,
        "machine": machine_info(model.device, model.dtype),
        "model": {
            "name": model.name,
            "source": without_folders(str(model.source)),
            "dtype": dtype_name(model.dtype),
            "page_size": options.page_size,
            "weights": options.weights,
            "kv": options.kv,
            "context_length": model.context_length,
        },
        "engines": {
            n: p.description
            for n, p in {"kvchat": kvchat, **variants}.items()
            | ({DISK_NAME: kvchat_disk} if kvchat_disk else {}).items()
        }
        | {n: p.description for n, p in {**speed_peers, **chat_peers}.items()},
        "skipped": skipped,
        "notes": list(plan.notes),
        "plan": {k: v for k, v in vars(plan).items() if k != "notes"},
        "workloads": {},
    }
    try:
        if set(workloads) - {"speed"}:  # speed warms its own engines up
            progress("Warming kvchat up (one short conversation)...")
            length = plan.sweep_lengths[0]
            opener = docs.history_of(model, docs.SWEEP_FILES[0], length)
            for peer in [kvchat, *([kvchat_disk] if kvchat_disk else [])]:
                peer.warm_up(opener, docs.FOLLOW_UPS[0], 2 * length + 256)
        for name in workloads:
            t0 = time.perf_counter()
            results["workloads"][name] = WORKLOADS[name].run(ctx)
            results["workloads"][name]["seconds"] = time.perf_counter() - t0
    finally:
        for peer in {id(p): p for p in [*chat_peers.values(), *speed_peers.values()]}.values():
            peer.close()
        if kvchat_disk is not None:
            kvchat_disk.close()
        shutil.rmtree(scratch, ignore_errors=True)
    results["seconds"] = time.perf_counter() - started
    out = Path(args.out) if args.out else default_out(results["machine"]["cpu"])
    try:
        written, notes = write_report(results, out)
    except OSError as exc:
        raise KvchatError(f"Could not write the bench report to {out} ({exc}).") from exc
    for note in notes:
        progress(f"kvchat bench: {note}")
    print(markdown(results), end="")
    progress(f"kvchat bench: {results['seconds']:.0f} s; wrote {', '.join(map(str, written))}")
    peers = {*chat_peers, *speed_peers}
    failed = [  # kvchat's own runs (W4's configurations are all kvchat's)
        n for n, w in results["workloads"].items() if set(w.get("errors", {})) - peers
    ]
    if failed:
        progress(f"kvchat bench: kvchat failed in {', '.join(failed)} (see the messages above)")
        return 1
    return 0
