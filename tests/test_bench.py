"""`kvchat bench --quick` end to end on a tiny random model, and the bench's small helpers.

The bench runs once per module (through the real command line, with the
transformers peers; llama.cpp needs a GGUF and is skipped for a Hugging Face
folder) and each test checks one promise of its JSON: every workload present,
sane numbers, kvchat's follow-ups computing only their new tokens plus one,
the cache tiers hitting, the report files written. Timings are not asserted
beyond being positive: this machine is shared and noisy.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvchat.bench.peers.base import batch_from_deltas
from kvchat.bench.peers.kvchat import percentile
from kvchat.bench.runner import parse_peers, parse_workloads
from kvchat.bench.workloads import WORKLOAD_NAMES
from kvchat.bench.workloads.plan import make_plan
from kvchat.bench.workloads.repeats import median_of_runs
from kvchat.cli import main
from kvchat.engine.token_ids import common_prefix
from kvchat.errors import KvchatError


@pytest.fixture(scope="module")
def bench(tmp_path_factory) -> tuple[int, dict, Path]:
    from tests.tiny_models import write_tiny_model

    root = tmp_path_factory.mktemp("bench")
    folder = write_tiny_model(root / "tiny", "llama")
    out = root / "out"
    with pytest.MonkeyPatch.context() as mp:  # module scope: its own kvchat home, no settings
        mp.setenv("KVCHAT_HOME", str(root / "home"))
        code = main(
            ["bench", "--quick", "--model", str(folder), "--dtype", "float32", "--out", str(out)]
        )
    return code, json.loads((out / "bench.json").read_text()), out


def test_quick_bench_exits_cleanly_with_every_workload(bench):
    code, results, _ = bench
    assert code == 0
    assert set(results["workloads"]) == set(WORKLOAD_NAMES)
    for name, workload in results["workloads"].items():
        assert workload["engines"], name
        assert not workload["errors"], (name, workload["errors"])


def test_transformers_peers_run_and_llama_cpp_is_skipped_with_a_reason(bench):
    _, results, _ = bench
    assert set(results["workloads"]["W1"]["engines"]) == {
        "kvchat",
        "transformers-naive",
        "transformers-cache",
    }
    assert "transformers" in results["workloads"]["speed"]["engines"]
    assert "transformers" in results["workloads"]["W2"]["engines"]
    assert results["skipped"]["llama.cpp"]  # a HF folder has no GGUF (or it is not installed)


def test_speed_numbers_are_positive_and_the_bandwidth_is_measured(bench):
    _, results, _ = bench
    speed = results["workloads"]["speed"]
    for entry in speed["engines"].values():
        median = entry["median"]
        assert median["decode_tok_s"] > 0
        assert median["short_decode_tok_s"] > 0
        assert set(median["prefill_tok_s"]) == {str(n) for n in speed["prompt_lengths"]}
        assert all(v > 0 for v in median["prefill_tok_s"].values())
    assert speed["memory_bandwidth_gbs"]["median"] > 0
    assert speed["weight_bytes_per_token"] > 0


def test_every_engine_compared_on_speed_has_its_processs_peak_memory(bench):
    """kvchat and transformers run in the bench's process: they share its figure."""
    _, results, out = bench
    for name in ("speed", "W1", "W2"):
        engines = results["workloads"][name]["engines"]
        for engine, entry in engines.items():
            peak = entry["peak_rss"]
            assert peak["bytes"] > 0 and peak["shared"] and peak["process"] == "bench", engine
        assert len({e["peak_rss"]["bytes"] for e in engines.values()}) == 1, name
    assert "transformers" in results["workloads"]["speed"]["engines"]
    text = (out / "bench.md").read_text()
    speed = text.split("## Speed", 1)[1].split("\n## ", 1)[0]
    assert "peak RSS (GiB)" in speed and "(the bench's process)" in speed
    assert "run in the bench's own process and share its figure" in speed


def test_kvchat_follow_ups_prefill_only_the_new_turn_plus_one_token(bench):
    _, results, _ = bench
    turns = results["workloads"]["W1"]["engines"]["kvchat"]["runs"][0]["turns"]
    follow_ups = [t for t in turns if t["turn"] > 1]
    assert len(follow_ups) == 4  # one round in --quick
    for t in follow_ups:
        assert 0 < t["prefilled_tokens"] <= t["new_tokens"] + 1, t
        assert t["prompt_tokens"] > t["prefilled_tokens"]  # the history came from the cache


def test_naive_transformers_recomputes_the_whole_history_every_turn(bench):
    _, results, _ = bench
    turns = results["workloads"]["W1"]["engines"]["transformers-naive"]["runs"][0]["turns"]
    assert all(t["prefilled_tokens"] == t["prompt_tokens"] for t in turns)
    assert all(t["generated_tokens"] == results["workloads"]["W1"]["answer_tokens"] for t in turns)


def test_switching_back_in_the_sweep_reuses_kvchats_cache(bench):
    _, results, _ = bench
    sweep = results["workloads"]["sweep"]
    points = sweep["engines"]["kvchat"]["runs"][0]["points"]
    assert [p["length"] for p in points] == sweep["lengths"]
    for p in points:
        assert p["prefilled_tokens"] < 64 < p["history_tokens"]


def test_w2_and_w3_report_rates_and_latencies(bench):
    _, results, _ = bench
    w2 = results["workloads"]["W2"]["engines"]["kvchat"]["median"]
    assert w2["decode_tok_s"] > 0 and w2["wall_s"] > 0
    w3 = results["workloads"]["W3"]["engines"]["kvchat"]["median"]
    assert w3["gaps_during_ingest"] > 0
    assert w3["gaps_alone"] >= 2 * 3 * 16 - 3  # 16 tokens a stream before and after (quick)
    assert w3["itl_p99_ingest_s"] >= w3["itl_p50_ingest_s"] > 0


def test_w4_host_tier_keeps_hits_that_a_small_device_cache_loses(bench):
    _, results, _ = bench
    w4 = results["workloads"]["W4"]
    runs = {name: e["median"] for name, e in w4["engines"].items()}
    everything, on, off = (
        runs["all on device"],
        runs["half, host tier on"],
        runs["half, host tier off"],
    )
    assert on["device_pages"] < everything["device_pages"]
    assert everything["hit_rate"] > 0 and on["hit_rate"] > 0
    assert on["cached_host_tokens"] > 0 and off["cached_host_tokens"] == 0
    assert on["hit_rate"] >= off["hit_rate"]


def test_report_files_and_markdown_name_the_machine_and_every_engine(bench):
    _, results, out = bench
    text = (out / "bench.md").read_text()
    assert results["machine"]["cpu"] in text
    for name in ("kvchat", "transformers-naive", "transformers-cache", "llama.cpp"):
        assert name in text
    assert results["targets"] and "## Targets (ratios within this run)" in text
    pytest.importorskip("matplotlib")
    assert (out / "w1_ttft.png").stat().st_size > 0
    assert (out / "sweep_ttft.png").stat().st_size > 0


def test_unknown_workloads_and_peers_are_user_errors():
    with pytest.raises(KvchatError, match="W9"):
        parse_workloads("speed,W9")
    with pytest.raises(KvchatError, match="sglang"):
        parse_peers("sglang")
    assert parse_workloads("w1, Sweep") == ["W1", "sweep"]
    assert parse_peers("transformers") == ["transformers-naive", "transformers-cache"]
    assert parse_peers("none") == []
    assert parse_peers("llama-server-1slot,llama-server") == ["llama-server", "llama-server-1slot"]


def test_plan_drops_sizes_beyond_the_models_context():
    plan = make_plan(quick=False, repeats=None, context_length=2048)
    assert max(plan.sweep_lengths) <= 2048 - 256
    assert plan.doc_tokens < 2048 and plan.w3_ingest_tokens < 2048
    assert plan.notes and plan.repeats == 3


def test_medians_are_taken_per_number_and_per_list_element():
    runs = [
        {"a": 1.0, "b": [1, 10], "c": "x"},
        {"a": 3.0, "b": [2, 30], "c": "x"},
        {"a": 2.0, "b": [3, 20], "c": "x"},
    ]
    assert median_of_runs(runs) == {"a": 2.0, "b": [2, 20], "c": "x"}


def test_percentile_is_nearest_rank_and_common_prefix_counts_shared_ids():
    assert percentile([5.0, 1.0, 3.0], 50) == 3.0
    assert percentile(list(range(1, 101)), 99) == 99
    assert percentile([], 99) == 0.0
    assert common_prefix([1, 2, 3], [1, 2, 4, 5]) == 2


def test_w2_from_streamed_text_counts_tokens_after_every_streams_first():
    # two streams sent at 0.0; the second's first text comes at 1.5
    deltas = [[0.5, 1.0, 2.0, 3.0], [1.5, 2.0, 3.0, 4.0]]
    one_a_delta = batch_from_deltas(deltas, [4, 4], 4, start=0.0)
    assert one_a_delta.decode_tok_s == pytest.approx(5 / 2.5)  # 2.0, 3.0 | 2.0, 3.0, 4.0
    assert one_a_delta.wall_s == 4.0 and one_a_delta.sequences == 2
    # a server that sent two tokens a delta in the first stream
    two_a_delta = batch_from_deltas(deltas, [8, 4], 8, start=0.0)
    assert two_a_delta.decode_tok_s == pytest.approx((2 * 2 + 3) / 2.5)


def _strings(value) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, dict):
        return [s for k, v in value.items() for s in (*_strings(k), *_strings(v))]
    if isinstance(value, list | tuple):
        return [s for v in value for s in _strings(v)]
    return []


def test_bench_json_says_what_produced_it_and_names_no_folder_of_the_machine(bench):
    _, results, out = bench
    assert results["kvchat"]["version"]
    git = results["kvchat"]["git"]
    assert git is None or len(git["commit"]) == 40
    assert results["machine"]["cpu"] and results["machine"]["torch"]
    assert results["command"].startswith("kvchat bench --quick --model tiny ")
    assert "--out out" in results["command"]
    assert not [s for s in _strings(results) if s.startswith("/") or str(out) in s]
    assert "- kvchat: " in (out / "bench.md").read_text()


def test_recorded_command_lines_cut_folders_and_quote_what_a_shell_would_split():
    from kvchat.bench.provenance import command_line, cpu_slug, default_out

    argv = ["bench", "--model=/home/me/m.gguf", "--out", "/tmp/x y", "--repeats", "1"]
    assert command_line(argv) == "kvchat bench --model=m.gguf --out 'x y' --repeats 1"
    assert cpu_slug("Intel(R) Xeon(R) Processor") == "intel-xeon"
    assert cpu_slug("AMD EPYC 9R14 96-Core Processor") == "amd-epyc-9r14-96-core"
    assert cpu_slug("Intel(R) Core(TM) i7-8650U CPU @ 1.90GHz") == "intel-core-i7-8650u"
    assert default_out("AMD EPYC").parts[:2] == ("benchmarks", "runs")


def test_the_default_bench_folder_is_ignored_by_git_and_the_committed_results_are_not():
    import subprocess

    root = Path(__file__).resolve().parents[1]
    if not (root / ".git").exists():
        pytest.skip("not a git checkout")
    kept = sorted((root / "benchmarks" / "results").glob("*/bench.json"))
    assert kept, "the latest full run per machine is committed under benchmarks/results/"

    def ignored(path: str) -> bool:
        done = subprocess.run(["git", "-C", str(root), "check-ignore", "-q", path], check=False)
        return done.returncode == 0

    assert ignored("benchmarks/runs/2026-01-01-0000-cpu/bench.json")
    assert not any(ignored(str(p.relative_to(root))) for p in kept)


def test_w7_type_aheads_serve_the_pasted_documents_without_changing_the_replies(bench):
    _, results, _ = bench
    w7 = results["workloads"]["W7"]
    assert w7["replies_identical"] is True
    plain = w7["engines"]["no draft"]["median"]
    ahead = w7["engines"][w7["long_pause_mode"]]["median"]
    assert plain["draft_tokens"] == 0
    assert ahead["draft_tokens"] > 0
    assert ahead["prefilled_tokens"] + ahead["draft_tokens"] == plain["prefilled_tokens"]
    phase = w7["interference"]["engines"]["3 streams + a draft"]["median"]
    assert phase["gaps_alone"] > 0 and phase["gaps_drafting"] > 0
    assert any(t["workload"] == "W7" for t in results["targets"])


def test_w5_follow_ups_run_in_a_new_process_on_the_first_processs_files(bench):
    _, results, _ = bench
    w5 = results["workloads"]["W5"]["engines"]
    kvchat = ("kvchat, disk tier, cold", "kvchat, disk tier, hot", "kvchat, no disk tier")
    for name in kvchat:
        run = w5[name]["runs"][0]
        assert run["restart_pid"] > 0 and run["restart_pid"] != os.getpid(), name
        assert len(run["ttft_per_follow_up_s"]) == 4
    recompute = w5["kvchat, no disk tier"]["runs"][0]
    assert recompute["cached_disk_follow_up_tokens"] == 0
    for name in kvchat[:2]:  # the new process read the pages the first one wrote
        run = w5[name]["runs"][0]
        assert run["cached_disk_follow_up_tokens"] > 0, name
        assert run["prefilled_follow_up_tokens"] < recompute["prefilled_follow_up_tokens"], name
        assert w5[name]["replies_same_as_recompute"] == "4/4", name  # float32: exact


def test_kvchat_is_warmed_up_before_the_first_measured_conversation(tmp_path, monkeypatch):
    """A process's first forward passes are slow: no workload may be the first to run."""
    from kvchat.bench.peers.kvchat import KvchatPeer
    from tests.tiny_models import write_tiny_model

    calls: list[str] = []
    warm_up, chat = KvchatPeer.warm_up, KvchatPeer.chat

    def recording_warm_up(self, *args, **kwargs):
        calls.append(f"warm {self.name}")
        return warm_up(self, *args, **kwargs)

    def recording_chat(self, *args, **kwargs):
        calls.append(f"chat {self.name}")
        return chat(self, *args, **kwargs)

    monkeypatch.setattr(KvchatPeer, "warm_up", recording_warm_up)
    monkeypatch.setattr(KvchatPeer, "chat", recording_chat)
    monkeypatch.setenv("KVCHAT_HOME", str(tmp_path / "home"))
    folder = write_tiny_model(tmp_path / "tiny", "llama")
    argv = ["bench", "--quick", "--workloads", "sweep", "--peers", "none", "--model", str(folder)]
    assert main([*argv, "--dtype", "float32", "--out", str(tmp_path / "out")]) == 0
    first_measured = calls.index("chat kvchat", calls.index("warm kvchat+disk"))
    assert calls[:first_measured] == [
        "warm kvchat",
        "chat kvchat",
        "warm kvchat+disk",
        "chat kvchat+disk",
    ]


def test_the_dense_comparison_is_left_out_where_it_would_pass_the_memory_budget():
    from types import SimpleNamespace

    import torch

    from kvchat.bench.runner import PROCESS_MEMORY_BUDGET, _dense_too_big

    cpu, options = torch.device("cpu"), SimpleNamespace(device_cache=1 << 20, host_cache=0)
    assert _dense_too_big(1 << 20, cpu, options) is None
    why = _dense_too_big(PROCESS_MEMORY_BUDGET, cpu, options)
    assert why is not None and "dense weights" in why and "12.0GiB it keeps to" in why
    # on a GPU the dense weights are not in the bench's own process
    assert _dense_too_big(PROCESS_MEMORY_BUDGET, torch.device("cuda"), options) is None
