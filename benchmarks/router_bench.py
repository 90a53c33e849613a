"""Two llama-server replicas behind a real router: does session affinity keep W1's cache?

kvchat sends each session's stable id in a header (`X-Session-ID`, its
`--session-header`), so a router with session affinity keeps a conversation on the
replica that holds its KV. This measures it, small, on one machine, with W1 (four
sessions over long documents, follow-ups round robin; docs/benchmarks.md):

- `single`: one llama-server, no router (the baseline of the bar below);
- `affinity`: two replicas behind vllm-router's `consistent_hash` policy, which hashes
  the `X-Session-ID` header (the first key it looks for);
- `cache-aware`: the same router's `cache_aware` policy (a prefix tree of what it sent
  where; no header needed);
- `round-robin`: the same router, round robin;
- `random`: the same router, a random replica per request.

Each setup starts fresh replicas (`llama-server -np 4 -c 32768 --metrics`, the recipe
of tests/servers.py, with one thread each, so that two replicas share a 2-core machine
without contending; the single server gets one thread too), puts the router in front,
runs `kvchat bench --engine http://127.0.0.1:PORT/v1 --workloads W1 --peers none
--repeats 1` through it (the bench also runs kvchat's embedded engine, shown as a
reference), and stops everything it started by its PID, also on a failure or ctrl-c.
Everything listens on 127.0.0.1 only.

Reported per setup, from the bench's JSON: W1's follow-up hit rate (the server's
cached tokens over the prompt tokens of the follow-up turns), the follow-ups' median
TTFT, and how the prompt tokens fell on the replicas (their `/metrics`). The bar: with
affinity, the follow-up hit rate through two replicas is at least 0.9 of one server's,
and clearly above round robin's. Written to `benchmarks/runs/router-DATE-CPU/`
(git-ignored): router.md, router.json, and each setup's bench output and logs.

    python benchmarks/router_bench.py              # the measurement (full W1)
    python benchmarks/router_bench.py --quick      # W1 at --quick sizes: checks the setup

The router, `vllm-router` from PyPI (a Rust binary in the wheel), is installed once
into its own venv, `router-venv-VERSION/` in the servers cache outside the checkout
(kvchat/testing/servers_dir.py), where benchmarks/servers/build_llama_server.sh
builds llama-server, as for the tests.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvchat.testing.servers_dir import servers_dir  # noqa: E402

ROUTER_PACKAGE = "vllm-router==0.1.17"
SESSION_HEADER = "X-Session-ID"  # kvchat's default; vllm-router's consistent_hash reads it
SERVED_NAME = "smollm2"
# setup -> (replicas, router policy; None: the replica itself, no router)
SETUPS: dict[str, tuple[int, str | None]] = {
    "single": (1, None),
    "affinity": (2, "consistent_hash"),
    "cache-aware": (2, "cache_aware"),
    "round-robin": (2, "round_robin"),
    "random": (2, "random"),
}
DEFAULT_SETUPS = ("single", "affinity", "cache-aware", "round-robin", "random")
BAR_OF_SINGLE = 0.9  # affinity keeps at least this share of one server's follow-up hit rate
CLEAR_MARGIN = 0.1  # "clearly above round robin": at least this much more, absolute
READY_TIMEOUT_S = 300.0


# ---- what runs: command lines --------------------------------------------------------------


def replica_argv(binary: Path, gguf: Path, port: int, threads: int) -> list[str]:
    """One llama-server replica: the tests' recipe (4 slots, 32k context, metrics)."""
    return [
        str(binary),
        *("-m", str(gguf), "--host", "127.0.0.1", "--port", str(port)),
        *("-np", "4", "-c", "32768", "--metrics", "--slots"),
        *("-t", str(threads), "--alias", SERVED_NAME),
    ]


def router_argv(
    router: Path, policy: str, port: int, workers: list[str], metrics_port: int
) -> list[str]:
    """vllm-router in front of `workers`, listening on 127.0.0.1 (its metrics too)."""
    return [
        str(router),
        *("--host", "127.0.0.1", "--port", str(port)),
        *("--worker-urls", *workers),
        *("--policy", policy),
        *("--prometheus-host", "127.0.0.1", "--prometheus-port", str(metrics_port)),
    ]


def bench_argv(url: str, out: Path, *, quick: bool, model: Path | None) -> list[str]:
    """`kvchat bench` through `url`: W1 only, no other peer, one repeat."""
    argv = [sys.executable, "-m", "kvchat", "bench", "--engine", url]
    argv += ["--workloads", "W1", "--peers", "none", "--repeats", "1"]
    argv += ["--session-header", SESSION_HEADER, "--out", str(out)]
    if quick:
        argv.append("--quick")
    if model is not None:
        argv += ["--model", str(model)]
    return argv


# ---- what it found: figures from the bench's JSON ------------------------------------------


def follow_up_figures(bench: dict, engine: str | None = None) -> dict:
    """W1's follow-up turns of one engine in a bench.json: their hit rate and TTFT.

    `engine` None: the bench's engine on the server (`kvchat@KIND`). The hit rate is
    the server's cached tokens over the follow-ups' prompt tokens, pooled over runs.
    """
    w1 = bench["workloads"]["W1"]
    engines = w1["engines"]
    if engine is None:
        remote = [name for name in engines if name.startswith("kvchat@")]
        if not remote:
            why = {**bench.get("skipped", {}), **w1.get("errors", {})}
            raise ValueError(f"the bench ran no engine on the server ({why or 'no reason given'})")
        engine = remote[0]
    entry = engines[engine]
    follow = [t for run in entry["runs"] for t in run["turns"] if t["turn"] > 1]
    prompt = sum(t["prompt_tokens"] for t in follow)
    cached = sum(t["prompt_tokens"] - t["prefilled_tokens"] for t in follow)
    return {
        "engine": engine,
        "follow_ups": len(follow),
        "prompt_tokens": prompt,
        "cached_tokens": cached,
        "hit_rate": cached / prompt if prompt else None,
        "ttft_follow_up_s": statistics.median(t["ttft_s"] for t in follow) if follow else None,
        "total_s": entry["median"]["total_s"],
    }


def verdict(figures: dict[str, dict]) -> list[str]:
    """The bar, checked on the setups that ran (random, when run, beside round robin)."""
    rate = {name: f.get("hit_rate") for name, f in figures.items()}
    single, affinity = rate.get("single"), rate.get("affinity")
    lines = []
    if single and affinity is not None:
        share = affinity / single
        met = "met" if share >= BAR_OF_SINGLE else "NOT met"
        lines.append(
            f"affinity keeps {share:.2f} of one server's follow-up hit rate "
            f"(bar: at least {BAR_OF_SINGLE}): {met}"
        )
    for other in ("round-robin", "random"):
        if affinity is None or rate.get(other) is None:
            continue
        gap = affinity - rate[other]
        met = "met" if gap >= CLEAR_MARGIN else "NOT met"
        lines.append(
            f"affinity's follow-up hit rate is {gap:+.2f} over {other}'s "
            f"(bar: clearly above, at least {CLEAR_MARGIN:+.2f}): {met}"
        )
    return lines


def markdown(report: dict) -> str:
    """router.md: the table, the bar, and what was run."""
    lines = [
        "# W1 through two llama-server replicas behind a router",
        "",
        f"{report['date']}, {report['cpu']}; {report['router']}; llama-server replicas "
        f"with {report['threads_per_replica']} thread(s) each; "
        f"{'--quick sizes' if report['quick'] else 'full W1'}.",
        "",
        "| setup | replicas | router policy | follow-up hit rate | follow-up TTFT median (s) "
        "| W1 total (s) | prompt tokens per replica (cached) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, s in report["setups"].items():
        f = s.get("figures") or {}
        hit = f.get("hit_rate")
        ttft = f.get("ttft_follow_up_s")
        split = ", ".join(
            f"{r.get('prompt_tokens') or 0:,.0f} ({r.get('cached_tokens') or 0:,.0f})"
            for r in s.get("replica_metrics", [])
        )
        cells = [
            name,
            str(s["replicas"]),
            s["policy"] or "none (the server itself)",
            "—" if hit is None else f"{hit:.3f}",
            "—" if ttft is None else f"{ttft:.3f}",
            "—" if f.get("total_s") is None else f"{f['total_s']:.1f}",
            split or "—",
        ]
        if s.get("error"):
            cells[3] = f"failed: {s['error']}"
        lines.append("| " + " | ".join(cells) + " |")
    embedded = report.get("embedded")
    if embedded and embedded.get("hit_rate") is not None:
        lines += [
            "",
            f"kvchat's embedded engine in the same runs (reference, W1 of the `single` "
            f"setup's bench): follow-up hit rate {embedded['hit_rate']:.3f}, follow-up TTFT "
            f"median {embedded['ttft_follow_up_s']:.3f} s.",
        ]
    lines += ["", *[f"- {line}" for line in report["verdict"]]]
    lines += ["", f"Command: `{report['command']}`", ""]
    return "\n".join(lines)


# ---- running it ----------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class Processes:
    """What this script started, each in its own process group; stopped by PID."""

    started: list[subprocess.Popen] = field(default_factory=list)

    def start(self, argv: list[str], log: Path, env: dict[str, str] | None = None):
        out = log.open("ab")
        process = subprocess.Popen(
            argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True
        )
        out.close()  # the child holds its own descriptor
        self.started.append(process)
        return process

    def stop_all(self) -> None:
        for process in reversed(self.started):
            if process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGTERM)
        for process in reversed(self.started):
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)
        self.started.clear()


def wait_ready(root: str, process: subprocess.Popen, log: Path, what: str) -> None:
    """Until `root`/v1/models lists a model; RuntimeError when the process exits or never is."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            tail = log.read_text(errors="replace").strip().splitlines()[-5:]
            raise RuntimeError(f"{what} exited at start: " + " | ".join(tail))
        with (
            contextlib.suppress(urllib.error.URLError, OSError, ValueError),
            urllib.request.urlopen(root + "/v1/models", timeout=5) as response,
        ):
            if response.status == 200 and json.load(response).get("data"):
                return
        time.sleep(0.5)
    raise RuntimeError(f"{what} was not ready after {READY_TIMEOUT_S:.0f} s (see {log})")


def replica_metrics(root: str) -> dict:
    """The replica's prompt tokens, and of them cached, from its /metrics."""
    from kvchat.remote.metrics import parse_metrics

    with urllib.request.urlopen(root + "/metrics", timeout=10) as response:
        m = parse_metrics(response.read().decode(), "llama-server")
    return {"prompt_tokens": m.prefix_queries, "cached_tokens": m.prefix_hits}


def router_venv() -> Path:
    """The router's venv in the servers cache, named by its version."""
    return servers_dir() / f"router-venv-{ROUTER_PACKAGE.split('==')[1]}"


def llama_server_binary() -> Path:
    """Built (or reused) in the servers cache by benchmarks/servers/build_llama_server.sh."""
    script = ROOT / "benchmarks" / "servers" / "build_llama_server.sh"
    done = subprocess.run(["bash", str(script)], capture_output=True, text=True)
    lines = done.stdout.strip().splitlines()
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"building llama-server failed: {done.stderr.strip()[-300:]}")
    return Path(lines[-1])


def router_binary(venv: Path) -> Path:
    """vllm-router installed from PyPI into `venv` (reused when it runs)."""
    binary = venv / "bin" / "vllm-router"
    works = binary.exists() and (
        subprocess.run([str(binary), "--help"], capture_output=True, timeout=60).returncode == 0
    )
    if not works:
        print(f"router_bench: installing {ROUTER_PACKAGE} into {venv} ...", flush=True)
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
        subprocess.run(
            [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", ROUTER_PACKAGE],
            check=True,
        )
    return binary


def run_setup(
    name: str, *, out: Path, llama: Path, gguf: Path, router: Path, threads: int, args
) -> dict:
    """Fresh replicas (and the router), the bench through them, their figures; all stopped."""
    replicas, policy = SETUPS[name]
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    result: dict = {"replicas": replicas, "policy": policy, "bench_dir": name}
    env = dict(os.environ, LD_LIBRARY_PATH=str(llama.parent))
    processes = Processes()
    try:
        roots = []
        for i in range(replicas):
            port = free_port()
            log = folder / f"replica-{i}.log"
            process = processes.start(replica_argv(llama, gguf, port, threads), log, env)
            roots.append(f"http://127.0.0.1:{port}")
            wait_ready(roots[-1], process, log, f"replica {i}")
        url = roots[0]
        if policy is not None:
            port, log = free_port(), folder / "router.log"
            argv = router_argv(router, policy, port, roots, free_port())
            process = processes.start(argv, log)
            url = f"http://127.0.0.1:{port}"
            wait_ready(url, process, log, "the router")
        print(f"router_bench: {name}: W1 through {url} ...", flush=True)
        bench = bench_argv(url + "/v1", folder, quick=args.quick, model=args.model)
        done = processes.start(bench, folder / "bench.log").wait()
        if done != 0:
            raise RuntimeError(f"kvchat bench exited {done} (see {folder / 'bench.log'})")
        data = json.loads((folder / "bench.json").read_text(encoding="utf-8"))
        result["figures"] = follow_up_figures(data)
        if name == "single":  # the reference line; its absence fails nothing
            with contextlib.suppress(KeyError, ValueError):
                result["embedded"] = follow_up_figures(data, "kvchat")
        result["replica_metrics"] = [replica_metrics(root) for root in roots]
    except (RuntimeError, ValueError, OSError, KeyError) as exc:
        result["error"] = str(exc)
        print(f"router_bench: {name} failed: {exc}", file=sys.stderr, flush=True)
    finally:
        processes.stop_all()
    return result


def main(argv: list[str] | None = None) -> int:
    from kvchat.bench.machine import cpu_model
    from kvchat.bench.provenance import cpu_slug, git_revision

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="W1 at kvchat bench's --quick sizes")
    parser.add_argument(
        "--setups",
        default=",".join(DEFAULT_SETUPS),
        help=f"comma-separated, of {', '.join(SETUPS)} (default: %(default)s)",
    )
    parser.add_argument("--threads", type=int, default=1, help="threads per replica")
    parser.add_argument("--model", type=Path, help="a GGUF (default: kvchat's default model)")
    parser.add_argument("--llama-server", type=Path, help="a llama-server binary")
    parser.add_argument("--out", type=Path, help="the run's folder (default: benchmarks/runs/)")
    args = parser.parse_args(argv)
    setups = [s.strip() for s in args.setups.split(",") if s.strip()]
    unknown = [s for s in setups if s not in SETUPS]
    if unknown or not setups:
        parser.error(f"unknown setups {unknown}; pick from {', '.join(SETUPS)}")

    def stop_on_term(signum, frame) -> None:  # SIGTERM: stop what was started, as ctrl-c
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop_on_term)
    cpu = cpu_model()
    now = dt.datetime.now(dt.UTC)
    out = args.out or ROOT / "benchmarks" / "runs" / f"router-{now:%Y-%m-%d-%H%M}-{cpu_slug(cpu)}"
    out.mkdir(parents=True, exist_ok=True)
    llama = args.llama_server or llama_server_binary()
    if args.model is not None:
        gguf = args.model
    else:
        from kvchat.model.default_model import ensure_default_gguf

        gguf = ensure_default_gguf(progress=lambda line: print(line, flush=True))
    router = router_binary(router_venv()) if any(SETUPS[s][1] for s in setups) else None
    report: dict = {
        "command": "python benchmarks/router_bench.py " + " ".join(sys.argv[1:] or []),
        "date": now.isoformat(timespec="seconds"),
        "cpu": cpu,
        "cores": os.cpu_count(),
        "kvchat": git_revision(),
        "router": ROUTER_PACKAGE,
        "session_header": SESSION_HEADER,
        "threads_per_replica": args.threads,
        "quick": args.quick,
        "model": gguf.name,
        "setups": {},
    }
    try:
        for name in setups:
            report["setups"][name] = run_setup(
                name,
                out=out,
                llama=llama,
                gguf=gguf,
                router=router,  # type: ignore[arg-type]
                threads=args.threads,
                args=args,
            )
    except KeyboardInterrupt:
        print("router_bench: interrupted; everything it started is stopped", file=sys.stderr)
        return 130
    figures = {n: s["figures"] for n, s in report["setups"].items() if s.get("figures")}
    report["verdict"] = verdict(figures)
    single = report["setups"].get("single", {})
    report["embedded"] = single.pop("embedded", None)
    (out / "router.json").write_text(json.dumps(report, indent=2), encoding="utf-8")
    (out / "router.md").write_text(markdown(report), encoding="utf-8")
    print(markdown(report))
    print(f"router_bench: wrote {out / 'router.md'} and {out / 'router.json'}")
    return 1 if any(s.get("error") for s in report["setups"].values()) else 0


if __name__ == "__main__":
    raise SystemExit(main())
