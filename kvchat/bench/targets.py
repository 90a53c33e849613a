"""kvchat's performance targets, checked against one bench run's medians.

Each target is a ratio measured in the same run (never against numbers from another
machine), so a noisy or slower machine moves kvchat and its peers together. A target
whose inputs are missing (a peer not installed, a workload not run) is left out,
not failed. In a `--quick` run the sizes are too small for the ratios to mean
much; the report says so.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Target:
    workload: str
    claim: str
    value: float
    target: float
    higher_is_better: bool

    @property
    def passed(self) -> bool:
        return self.value >= self.target if self.higher_is_better else self.value <= self.target

    def to_json(self) -> dict[str, object]:
        return {**asdict(self), "passed": self.passed}


def _median(results: dict, workload: str, engine: str) -> dict | None:
    entry = results.get("workloads", {}).get(workload, {}).get("engines", {}).get(engine)
    return entry["median"] if entry else None


def check_targets(results: dict) -> list[Target]:
    targets: list[Target] = []
    theirs = _median(results, "speed", "transformers")
    # the same-dtype comparison: kvchat with dense weights when its default is quantized
    name = "kvchat-dense" if _median(results, "speed", "kvchat-dense") else "kvchat"
    ours = _median(results, "speed", name)
    if ours and theirs:
        if theirs["decode_tok_s"]:
            targets.append(
                Target(
                    "speed",
                    f"{name} decode at batch 1 vs transformers (x)",
                    ours["decode_tok_s"] / theirs["decode_tok_s"],
                    1.7,
                    True,
                )
            )
        first = next(iter(ours["prefill_tok_s"]), None)
        if first and first in theirs["prefill_tok_s"] and theirs["prefill_tok_s"][first]:
            targets.append(
                Target(
                    "speed",
                    f"{name} prefill {first} vs transformers (x)",
                    ours["prefill_tok_s"][first] / theirs["prefill_tok_s"][first],
                    1.2,
                    True,
                )
            )
    w1 = _median(results, "W1", "kvchat")
    if w1:
        targets.append(
            Target(
                "W1",
                "prefilled tokens beyond each follow-up's new tokens",
                w1["follow_up_excess_prefill"],
                1,
                False,
            )
        )
        for peer, target in (
            ("transformers-naive", 1 / 3.5),
            ("transformers-cache", 0.6),
            ("llama.cpp", 1 / 5),
        ):
            other = _median(results, "W1", peer)
            if other and other["total_s"]:
                targets.append(
                    Target(
                        "W1",
                        f"total time vs {peer} (fraction)",
                        w1["total_s"] / other["total_s"],
                        target,
                        False,
                    )
                )
    sweep = _median(results, "sweep", "kvchat")
    if sweep:
        targets.append(
            Target(
                "sweep",
                "slowest follow-up TTFT after a switch (s)",
                max(sweep["ttft_s"]),
                0.08,
                False,
            )
        )
    w2, hf2 = _median(results, "W2", "kvchat"), _median(results, "W2", "transformers")
    if w2 and hf2 and hf2["decode_tok_s"]:
        targets.append(
            Target(
                "W2",
                "aggregate decode vs transformers batched generate (x)",
                w2["decode_tok_s"] / hf2["decode_tok_s"],
                1.4,
                True,
            )
        )
    w3 = _median(results, "W3", "kvchat")
    if w3 and w3["itl_p99_alone_s"]:
        targets.append(
            Target(
                "W3",
                "streams' p99 inter-token latency during an ingest vs alone (x)",
                w3["p99_ratio"],
                3.0,
                False,
            )
        )
    on = _median(results, "W4", "half, host tier on")
    everything = _median(results, "W4", "all on device")
    if on and everything and everything["hit_rate"]:
        targets.append(
            Target(
                "W4",
                "hit rate, half device cache + host tier vs all on device",
                on["hit_rate"] / everything["hit_rate"],
                0.9,
                True,
            )
        )
    targets.extend(_w7_targets(results))
    recompute = _median(results, "W5", "kvchat, no disk tier")
    for variant in ("cold", "hot"):
        disk = _median(results, "W5", f"kvchat, disk tier, {variant}")
        if disk and recompute and recompute["ttft_follow_up_s"]:
            targets.append(
                Target(
                    "W5",
                    f"follow-up TTFT after a restart, disk tier ({variant}) vs recompute",
                    disk["ttft_follow_up_s"] / recompute["ttft_follow_up_s"],
                    1 / 5,
                    False,
                )
            )
    on, off = (
        _median(results, "W6", "kvchat, disk tier on"),
        _median(results, "W6", "kvchat, disk tier off"),
    )
    if on and off and off["ttft_follow_up_p95_s"]:
        targets.append(
            Target(
                "W6",
                "p95 follow-up TTFT, disk tier on vs off",
                on["ttft_follow_up_p95_s"] / off["ttft_follow_up_p95_s"],
                1 / 3,
                False,
            )
        )
    for workload in ("sweep", "W2"):
        base, disk = _median(results, workload, "kvchat"), _median(results, workload, "kvchat+disk")
        if not (base and disk):
            continue
        if workload == "sweep" and max(base["ttft_s"]):
            value = max(disk["ttft_s"]) / max(base["ttft_s"])
            claim, higher = "slowest switch TTFT, disk tier on vs off (x)", False
        elif workload == "W2" and base["decode_tok_s"]:
            value = disk["decode_tok_s"] / base["decode_tok_s"]
            claim, higher = "aggregate decode, disk tier on vs off (x)", True
        else:
            continue
        # "within noise": this machine varies by about 5% from run to run
        targets.append(Target(workload, claim, value, 0.95 if higher else 1.05, higher))
    return targets


def _w7_targets(results: dict) -> list[Target]:
    """Type-ahead: the first turn's TTFT after an 8 s pause, the streams while a type-ahead runs."""
    out: list[Target] = []
    w7 = results.get("workloads", {}).get("W7", {})
    plain = _median(results, "W7", "no draft")
    ahead = _median(results, "W7", w7.get("long_pause_mode", ""))
    if plain and ahead:
        out.append(
            Target(
                "W7",
                f"first-turn TTFT with type-ahead, {w7.get('long_pause_mode')} "
                "(s; 0.15 or 1/5 of without)",
                ahead["ttft_first_turn_s"],
                max(0.15, plain["ttft_first_turn_s"] / 5),
                False,
            )
        )
    if w7.get("engines") and results.get("model", {}).get("dtype") == "float32":
        out.append(
            Target(
                "W7",
                "replies identical with and without drafts (1: yes)",
                float(bool(w7.get("replies_identical"))),
                1.0,
                True,
            )
        )
    phase = w7.get("interference", {}).get("engines", {}).get("3 streams + a draft")
    if phase and phase["median"]["itl_p99_alone_s"]:
        out.append(
            Target(
                "W7",
                "streams' p99 inter-token latency while a draft runs vs alone (x)",
                phase["median"]["p99_ratio"],
                1.1,
                False,
            )
        )
    return out
