"""What every workload is given: the model, the engines, the plan, a progress line.

Every engine is driven by the same workload code; what differs is only how each keeps
its state (`peers/`). kvchat appears here in up to three forms: as configured, with its
weights dense (speed's same-dtype comparison), and with its disk tier on.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kvchat.bench.peers.base import ChatPeer, SpeedPeer
from kvchat.bench.peers.kvchat import KvchatPeer
from kvchat.bench.restart_phase import ModelLoad
from kvchat.bench.workloads.plan import BenchPlan

DISK_NAME = "kvchat+disk"  # kvchat with its disk tier on, beside kvchat without (sweep, W2)


@dataclass
class BenchContext:
    """What the workloads need: the model, the engines, the plan, a progress line."""

    model: object  # kvchat.model.loader.LoadedModel
    plan: BenchPlan
    kvchat: KvchatPeer
    chat_peers: dict[str, ChatPeer] = field(default_factory=dict)
    speed_peers: dict[str, SpeedPeer] = field(default_factory=dict)
    # kvchat with its weights dense in the compute dtype, when its default is quantized:
    # the same-dtype comparison with transformers (speed only)
    kvchat_variants: dict[str, KvchatPeer] = field(default_factory=dict)
    # kvchat with its disk tier on (a fresh folder per engine): sweep and W2 run it beside
    # kvchat to show the tier costs nothing there; W5 and W6 are about it
    kvchat_disk: KvchatPeer | None = None
    scratch: Path | None = None  # a folder on the cache's disk for W5's and W6's files
    progress: Callable[[str], None] = lambda _m: None
    model_load: ModelLoad | None = None  # how `model` was loaded: W5's restart loads it again


def disk_variant(ctx: BenchContext) -> list[tuple[str, KvchatPeer]]:
    """kvchat with its disk tier, named, when the run has it (to run beside kvchat)."""
    return [] if ctx.kvchat_disk is None else [(DISK_NAME, ctx.kvchat_disk)]


def scratch_folder(ctx: BenchContext, prefix: str) -> Path:
    """A new, empty folder for one run's files, on the cache's disk when the bench has one."""
    root = ctx.scratch or Path(tempfile.gettempdir())
    root.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix=prefix, dir=root))
