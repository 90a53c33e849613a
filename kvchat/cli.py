"""The `kvchat` command: argument parsing and wiring, nothing else.

Every user-caused failure surfaces as a `KvchatError` and is printed as one clear
message (exit 1; 2 for bad input: a `UsageError`); anything unexpected is logged with its
traceback to the error log and reported in one line that says where the log is.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _add_model_options(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        metavar="PATH_OR_NAME",
        help="GGUF file, Hugging Face folder, or a name from `kvchat models` "
        "(default: SmolLM2-135M-Instruct)",
    )
    p.add_argument(
        "--dtype",
        choices=["bfloat16", "float32"],
        help="activation dtype (default: bfloat16 where the hardware computes it natively)",
    )
    p.add_argument("--device", help="cpu or cuda (default: cuda when present)")
    p.add_argument(
        "--weights",
        choices=["native", "bf16"],
        help="native: keep a GGUF's 4-bit weights 4-bit (fast decode, the default); "
        "bf16: dequantize",
    )
    p.add_argument(
        "--quantize",
        choices=["int8", "int4"],
        help="quantize a Hugging Face folder's weights at load",
    )
    p.add_argument(
        "--kv",
        choices=["native", "int8"],
        help="KV cache format: the compute dtype, or int8 (about 1.9x the tokens per byte)",
    )
    p.add_argument(
        "--attention",
        choices=["native", "flex", "sdpa"],
        help="what reads the KV cache: native (kvchat's CPU kernel, the CPU's default), "
        "flex (torch FlexAttention, compiled; the default on CUDA) or sdpa (torch SDPA)",
    )
    p.add_argument(
        "--device-cache", metavar="SIZE", help="KV cache on the compute device, e.g. 512MiB, 4GiB"
    )
    p.add_argument(
        "--host-cache", metavar="SIZE", help="KV cache tier in host memory (0 disables it)"
    )
    p.add_argument(
        "--disk-cache",
        metavar="SIZE",
        help="KV cache tier on disk, kept across restarts (0 disables it; "
        "default: 8GiB or a tenth of the free disk, the smaller)",
    )
    p.add_argument(
        "--page-size", type=int, metavar="N", help="tokens per KV page (power of two, >= 16)"
    )
    p.add_argument(
        "--context-size",
        type=int,
        metavar="N",
        help="the most tokens a conversation holds (default: the model's context); fewer "
        "bound its KV cache, and older turns are left out of the prompt sooner",
    )
    p.add_argument(
        "--engine",
        metavar="URL|embedded",
        help="an OpenAI-compatible server (vLLM, SGLang, llama-server), e.g. "
        "http://127.0.0.1:8000/v1, or embedded (the default)",
    )
    p.add_argument(
        "--remote-model", metavar="NAME", help="the served model (default: the server's first)"
    )
    p.add_argument(
        "--api-key-env",
        metavar="NAME",
        help="environment variable holding the server's API key (default: OPENAI_API_KEY)",
    )
    p.add_argument(
        "--session-header",
        metavar="NAME",
        help="header carrying the session id, for routers (default: X-Session-ID)",
    )
    p.add_argument("--seed", type=int, metavar="N")
    p.add_argument("--temperature", type=float, metavar="X", help="0 means greedy")
    p.add_argument("--max-tokens", type=int, metavar="N")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvchat",
        description="Chat with local LLMs; switching conversations never re-reads their history.",
    )
    sub = parser.add_subparsers(dest="command")
    chat = sub.add_parser("chat", help="open the terminal UI (the default)")
    _add_model_options(chat)
    chat.add_argument(
        "--theme",
        help="colour theme for this run: kvchat-dark, kvchat-light, kvchat-high-contrast or "
        "one of your own (the settings file's `theme` otherwise; choosing one in the "
        "palette saves it there)",
    )
    ask = sub.add_parser("ask", help="answer one question, streamed to stdout")
    ask.add_argument("question")
    ask.add_argument("--system", help="system prompt")
    _add_model_options(ask)
    from kvchat.script import script_format_help

    run = sub.add_parser(
        "run",
        help="headless scripted mode: run a JSON Lines script",
        description="Run a JSON Lines script over kvchat's sessions with no UI; "
        "events are printed as JSON Lines.",
        epilog=script_format_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    run.add_argument("script", help="path to the script, or - for standard input")
    run.add_argument("--stream", action="store_true", help="also print token events")
    run.add_argument(
        "--save", action="store_true", help="store the sessions in the database the TUI shows"
    )
    _add_model_options(run)
    bench = sub.add_parser("bench", help="measure kvchat against peers on this machine")
    bench.add_argument("--quick", action="store_true", help="a reduced run (under 2 minutes)")
    bench.add_argument("--workloads", default=None, help="comma-separated subset, e.g. speed,W1,W2")
    bench.add_argument(
        "--peers", default=None, help="comma-separated peers (default: all installed)"
    )
    bench.add_argument("--repeats", type=int, default=None)
    bench.add_argument(
        "--llama-server", metavar="PATH", help="a llama-server binary, measured as a peer"
    )
    bench.add_argument(
        "--vllm-python",
        metavar="PATH",
        help="the Python of a venv with vLLM installed, measured as a peer",
    )
    bench.add_argument(
        "--cpu",
        choices=("native", "avx2"),
        default="native",
        help="avx2: run on an emulated AVX2 CPU (float32, no AVX-512), as most laptops",
    )
    bench.add_argument(
        "--out",
        default=None,
        help="folder for the JSON, Markdown and PNG (default: benchmarks/runs/DATE-CPU, "
        "git-ignored)",
    )
    bench.add_argument(
        "--model-shape",
        metavar="NAME[:QUANT]",
        help="measure a model of a real shape with random weights, made once (llama-3.2-1b, "
        "qwen2.5-1.5b, gemma-3-270m, gemma-3-1b, qwen3-30b-a3b-2l: Qwen3-30B-A3B cut to 2 "
        "layers; Q4_0 or Q4_K_M, the default) in place of --model",
    )
    bench.add_argument(
        "--list-shapes", action="store_true", help="list the shapes made so far and their sizes"
    )
    bench.add_argument("--remove-shape", metavar="NAME", help="remove a made shape's files")
    _add_model_options(bench)
    cache = sub.add_parser(
        "cache", help="show the KV cache tiers' sizes; `cache clear` empties disk"
    )
    cache.add_argument("action", nargs="?", choices=["clear"], help="clear: empty the disk tier")
    for tier in ("device", "host", "disk"):
        cache.add_argument(f"--{tier}-cache", metavar="SIZE", help="as for `kvchat chat`")
    sub.add_parser(
        "models",
        help="list the models on this machine (Hugging Face cache, Ollama, LM Studio, "
        "model_dirs) and whether kvchat runs each",
    )
    pull = sub.add_parser(
        "pull",
        help="fetch a model from the Hugging Face hub (HF_TOKEN, HF_ENDPOINT honoured)",
    )
    pull.add_argument("name", help="ORG/NAME, or ORG/NAME:QUANT for one file of a GGUF repository")
    sub.add_parser("paths", help="print where kvchat keeps its files")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from kvchat.errors import KvchatError, UsageError

    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or (argv[0].startswith("-") and argv[0] not in ("-h", "--help")):
        argv = ["chat", *argv]  # `kvchat --model X` opens the TUI like `kvchat chat --model X`
    args = parser.parse_args(argv)
    args.argv = argv  # `kvchat bench` records the command line it ran
    command = args.command
    from kvchat.chat.error_log import configure_error_log

    configure_error_log()  # every command's unexpected errors are kept, not just the TUI's
    refused = _refuse_embedded_flags(args)
    if refused:
        print(f"kvchat: {refused}", file=sys.stderr)
        return 2
    try:
        if command == "ask":
            from kvchat.ask import run_ask

            return run_ask(args)
        if command == "models":
            from kvchat.models_command import run_models

            return run_models()
        if command == "pull":
            from kvchat.model.pull import pull

            pulled = pull(args.name, progress=lambda m: print(m, file=sys.stderr))
            print(f"{pulled.path}\nRun it with: kvchat --model {pulled.name}")
            return 0
        if command == "cache":
            from kvchat.cache_command import run_cache

            return run_cache(args)
        if command == "paths":
            from kvchat.chat.error_log import paths_report

            print(paths_report())
            return 0
        if command == "run":
            from kvchat.headless import main as headless_main

            return headless_main(args)
        if command == "bench":
            from kvchat.bench.runner import main as bench_main

            return bench_main(args)
        from kvchat.tui.main import run_tui

        return run_tui(args)
    except UsageError as exc:
        print(f"kvchat: {exc}", file=sys.stderr)
        return 2
    except KvchatError as exc:
        print(f"kvchat: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("kvchat: interrupted", file=sys.stderr)
        return 130
    except OSError as exc:
        if getattr(exc, "errno", None) == 28:
            print(
                f"kvchat: the disk is full ({exc}). Free some space and try again.", file=sys.stderr
            )
            return 1
        return _unexpected(exc)
    except Exception as exc:
        return _unexpected(exc)


def _refuse_embedded_flags(args: argparse.Namespace) -> str | None:
    """Why the command line mixes a remote server with the embedded engine's flags, or None."""
    if not hasattr(args, "engine"):
        return None
    if args.command == "bench":  # the embedded engine always runs; a server is a peer beside it
        return None
    from kvchat.errors import KvchatError
    from kvchat.remote.options import embedded_flag_given, remote_options
    from kvchat.runtime import read_settings

    try:
        # quietly: the command itself reads the settings again and says what is wrong once
        remote = remote_options(args, read_settings(warn=lambda _problem: None))
    except KvchatError as exc:
        return str(exc)
    flag = embedded_flag_given(args) if remote is not None else None
    if flag is None:
        return None
    return (
        f"{flag} is an option of the embedded engine; with the server at {remote.url} the "
        "server decides it (use --remote-model to pick a served model, or --engine embedded)"
    )


def _unexpected(exc: BaseException) -> int:
    from kvchat.chat.error_log import log_exception
    from kvchat.paths import app_paths

    log_exception(f"unexpected error: {exc!r}")
    print(
        f"kvchat: unexpected error: {exc}. The details are in {app_paths().error_log}; "
        "please include them in a bug report.",
        file=sys.stderr,
    )
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
