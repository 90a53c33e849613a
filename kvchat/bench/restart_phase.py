"""W5's restart: kvchat's follow-up turns in a new OS process, as a user restarting kvchat.

The bench process writes a `RestartSpec` (how the model was loaded, the engine's exact
configuration, the database, the sessions and the follow-up) and runs
`python -m kvchat.bench.restart_phase SPEC RESULT`. The new process loads the model,
opens the same database and disk-tier folder with a fresh engine, and asks each
session's follow-up through the same `KvchatChat.turn` the bench uses everywhere (greedy,
exactly `max_tokens` tokens, end-of-sequence ignored; TTFT from the turn's start to its
first token, the model load outside it). It writes its turns and its process id to
RESULT. `kvchat run` cannot be the new process: its scripts only reach sessions they
create, and its reply events time from the engine's submit rather than the turn's start.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import kvchat
from kvchat.bench.peers.base import TurnResult
from kvchat.engine.config import EngineConfig
from kvchat.errors import KvchatError


@dataclass(frozen=True)
class ModelLoad:
    """What `load_model` needs to load the bench's model again, as it was loaded."""

    source: str  # the resolved GGUF file or folder
    dtype: str
    device: str
    weights: str
    quantize: str | None
    fingerprint: str  # the new process checks it: another one would miss every cached page


@dataclass(frozen=True)
class RestartSpec:
    """Everything the new process needs to be the same kvchat on the same files."""

    model: ModelLoad
    engine: dict  # EngineConfig's fields (the disk-tier folder as a string)
    store_path: str
    sessions: tuple[str, ...]
    text: str  # the follow-up asked in every session, in order
    max_tokens: int


@dataclass(frozen=True)
class RestartResult:
    pid: int  # the new process's
    turns: list[TurnResult]


def model_load(model, weights: str, quantize: str | None) -> ModelLoad:
    """How `model` (a `LoadedModel`) was loaded, to load it the same way elsewhere."""
    from kvchat.model.device import dtype_name

    return ModelLoad(
        source=str(model.source),
        dtype=dtype_name(model.dtype),
        device=str(model.device),
        weights=weights,
        quantize=quantize,
        fingerprint=model.fingerprint,
    )


def engine_fields(config: EngineConfig) -> dict:
    out = asdict(config)
    if config.disk_cache_dir is not None:
        out["disk_cache_dir"] = str(config.disk_cache_dir)
    return out


def engine_config(data: dict) -> EngineConfig:
    folder = data.get("disk_cache_dir")
    return EngineConfig(**{**data, "disk_cache_dir": Path(folder) if folder else None})


def run_in_new_process(spec: RestartSpec, folder: Path, timeout_s: float) -> RestartResult:
    """Run the follow-ups in a new Python process on this kvchat's code; its turns.

    `folder` holds the spec and result files. A failed process is a `KvchatError`
    carrying the end of its error output.
    """
    spec_file, result_file = folder / "restart-spec.json", folder / "restart-result.json"
    spec_file.write_text(json.dumps(asdict(spec)), encoding="utf-8")
    result_file.unlink(missing_ok=True)
    env = dict(os.environ)
    # this checkout's kvchat, whatever the current folder or an installed copy would give
    code_root = str(Path(kvchat.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (code_root, env.get("PYTHONPATH")) if p)
    command = [sys.executable, "-m", "kvchat.bench.restart_phase", str(spec_file), str(result_file)]
    try:
        done = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired:
        raise KvchatError(
            f"the restarted kvchat process did not finish in {timeout_s:.0f} s"
        ) from None
    if done.returncode != 0 or not result_file.exists():
        tail = "\n".join(done.stderr.strip().splitlines()[-20:])
        raise KvchatError(f"the restarted kvchat process failed (exit {done.returncode}):\n{tail}")
    data = json.loads(result_file.read_text(encoding="utf-8"))
    return RestartResult(data["pid"], [TurnResult(**t) for t in data["turns"]])


def _read_spec(path: Path) -> RestartSpec:
    data = json.loads(path.read_text(encoding="utf-8"))
    known = {f.name for f in fields(RestartSpec)}
    data = {k: v for k, v in data.items() if k in known}
    return RestartSpec(
        **{**data, "model": ModelLoad(**data["model"]), "sessions": tuple(data["sessions"])}
    )


def follow_ups(spec: RestartSpec) -> list[TurnResult]:
    """In this process: load the model, open kvchat on the spec's files, ask the follow-ups."""
    from kvchat.bench.peers.kvchat import KvchatChat
    from kvchat.model.loader import load_model
    from kvchat.native import build as native_build

    m = spec.model
    model = load_model(
        m.source, dtype=m.dtype, device=m.device, weights=m.weights, quantize=m.quantize
    )
    if model.fingerprint != m.fingerprint:
        raise KvchatError(f"the model loaded as {model.fingerprint}, not {m.fingerprint}")
    config = engine_config(spec.engine)
    if model.transformer.device.type == "cpu":
        native_build.request(wait=True)  # the kernels the bench process measured with
    chat = KvchatChat(model, config, Path(spec.store_path))
    try:
        return [chat.turn(s, spec.text, spec.max_tokens) for s in spec.sessions]
    finally:
        chat.close()  # a clean quit again: the database and the disk tier are left whole


def main(argv: list[str]) -> int:
    spec_file, result_file = (Path(a) for a in argv)
    turns = follow_ups(_read_spec(spec_file))
    result = {"pid": os.getpid(), "turns": [asdict(t) for t in turns]}
    result_file.write_text(json.dumps(result), encoding="utf-8")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
