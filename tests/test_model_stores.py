"""The models other tools keep, found in place: Hugging Face's hub cache (its real layout
of blobs, refs and snapshot links), Ollama's manifests and blobs, LM Studio's folders and
the user's `model_dirs`; `kvchat models` lists them with what their files say, and
`--model NAME` runs one without writing into the other tool's folder.

Every store is built in a temporary HOME (HF_HOME, OLLAMA_MODELS and ~/.lmstudio under
it): the user's own are never read.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvchat.errors import ModelLoadError
from kvchat.model.model_stores import describe, quant_in_name
from kvchat.model.registry import known_models, resolve_model
from tests.tiny_gguf import write_tiny_gguf


def hub_repo(hub: Path, repo_id: str, files: dict[str, Path]) -> Path:
    """A model repository as huggingface_hub caches it: content-addressed blobs, a ref,
    and a snapshot of relative links to them. Returns the snapshot."""
    repo = hub / ("models--" + repo_id.replace("/", "--"))
    commit = hashlib.sha1(repo_id.encode()).hexdigest()
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (repo / "blobs").mkdir()
    for name, source in files.items():
        data = source.read_bytes()
        blob = repo / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        os.symlink(os.path.relpath(blob, snapshot), snapshot / name)
    return snapshot


def ollama_tag(root: Path, name: str, tag: str, gguf: Path, namespace: str = "library") -> Path:
    """An Ollama tag: a manifest naming the model's blob by digest (and a template
    layer, as Ollama writes one)."""
    data = gguf.read_bytes()
    digest = hashlib.sha256(data).hexdigest()
    (root / "blobs").mkdir(parents=True, exist_ok=True)
    blob = root / "blobs" / f"sha256-{digest}"
    blob.write_bytes(data)
    manifest = root / "manifests" / "registry.ollama.ai" / namespace / name / tag
    manifest.parent.mkdir(parents=True, exist_ok=True)
    model = {"mediaType": "application/vnd.ollama.image.model", "digest": f"sha256:{digest}"}
    template = {
        "mediaType": "application/vnd.ollama.image.template",
        "digest": "sha256:" + "0" * 64,
    }
    layers = [{**model, "size": len(data)}, {**template, "size": 10}]
    manifest.write_text(json.dumps({"schemaVersion": 2, "layers": layers}))
    return blob


@pytest.fixture
def stores(tmp_path, monkeypatch, tiny_llama_dir):
    """A HOME holding one model in every store, and a `model_dirs` folder."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("HF_HOME", str(home / ".cache" / "huggingface"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("OLLAMA_MODELS", str(home / ".ollama" / "models"))
    q4 = write_tiny_gguf(tmp_path / "tiny-Q4_1.gguf", "Q4_1")
    q8 = write_tiny_gguf(tmp_path / "tiny-Q4_0.gguf", "Q4_0", seed=1)
    hub = home / ".cache" / "huggingface" / "hub"
    folder_files = {p.name: p for p in tiny_llama_dir.iterdir() if p.is_file()}
    paths = {
        "hf": hub_repo(hub, "tiny-org/tiny-llama", folder_files),
        "hf-gguf": hub_repo(
            hub, "tiny-org/tiny-GGUF", {"tiny.Q4_1.gguf": q4, "tiny.Q4_0.gguf": q8}
        ),
        "ollama": ollama_tag(home / ".ollama" / "models", "tiny", "2m", q4),
        "ollama-user": ollama_tag(home / ".ollama" / "models", "tiny", "latest", q8, "someone"),
    }
    lms = home / ".lmstudio" / "models" / "tiny-pub" / "tiny-model"
    lms.mkdir(parents=True)
    shutil.copy(q4, lms / "tiny-model-Q4_1.gguf")
    shutil.copy(q8, lms / "mmproj-tiny-model-f16.gguf")  # a vision projector: not a model
    paths["lmstudio"] = lms / "tiny-model-Q4_1.gguf"
    mine = tmp_path / "my-models"
    shutil.copytree(tiny_llama_dir, mine / "my-llama")
    shutil.copy(q8, mine / "mine-Q4_0.gguf")
    paths["folder"] = mine
    return paths


def by_name(model_dirs=()) -> dict[str, tuple[str, Path]]:
    return {m.name: (m.kind, m.path) for m in known_models(model_dirs) if m.kind != "default"}


def test_every_store_is_found_in_place_with_names_for_model(stores):
    found = by_name([str(stores["folder"])])
    assert found["tiny-org/tiny-llama"] == ("hf-cache", stores["hf"])
    assert found["tiny-org/tiny-GGUF:Q4_1"] == ("hf-cache", stores["hf-gguf"] / "tiny.Q4_1.gguf")
    assert found["tiny-org/tiny-GGUF:Q4_0"][0] == "hf-cache"
    assert found["tiny:2m"] == ("ollama", stores["ollama"])
    assert found["someone/tiny:latest"] == ("ollama", stores["ollama-user"])
    assert found["tiny-pub/tiny-model"] == ("lmstudio", stores["lmstudio"])
    assert found["my-llama"] == ("folder", stores["folder"] / "my-llama")
    assert found["mine-Q4_0"][0] == "folder"
    assert not any("mmproj" in name for name in found)
    assert "my-llama" not in by_name()  # model_dirs only when given


def test_names_resolve_exactly_by_base_name_or_refuse_listing_the_candidates(stores):
    assert resolve_model("tiny:2m") == stores["ollama"]
    assert resolve_model("TINY-ORG/TINY-GGUF:q4_0") == stores["hf-gguf"] / "tiny.Q4_0.gguf"
    assert resolve_model("tiny-org/tiny-llama") == stores["hf"]
    assert resolve_model("tiny-pub/tiny-model") == stores["lmstudio"]
    assert resolve_model("TINY-LLAMA") == stores["hf"]  # without its ORG/ part
    with pytest.raises(ModelLoadError, match=r"names several models: .*:Q4_1.*:Q4_0|:Q4_0.*:Q4_1"):
        resolve_model("tiny-org/tiny-GGUF")
    with pytest.raises(ModelLoadError, match="kvchat models"):
        resolve_model("no-such/model")
    path = resolve_model("my-llama", model_dirs=[str(stores["folder"])])
    assert path == stores["folder"] / "my-llama"


def test_each_model_is_described_by_its_files(stores, tmp_path):
    gguf = describe(stores["ollama"])
    assert (gguf.format, gguf.quantization, gguf.architecture, gguf.supported) == (
        "gguf", "Q4_1", "llama", True,
    )  # fmt: skip
    assert gguf.size == stores["ollama"].stat().st_size
    hf = describe(stores["hf"])  # its safetensors are links into the cache's blobs
    assert (hf.format, hf.architecture, hf.supported) == ("hf", "llama", True) and hf.size > 0
    other = tmp_path / "falcon-h1"
    shutil.copytree(stores["hf"], other, symlinks=False)
    config = json.loads((other / "config.json").read_text())
    (other / "config.json").write_text(json.dumps({**config, "model_type": "falcon_h1"}))
    refused = describe(other)
    assert not refused.supported and "Unsupported architecture" in refused.reason
    assert quant_in_name("Qwen3-1.7B-Q4_K_M.gguf") == "Q4_K_M"
    assert quant_in_name("model.IQ4_XS.gguf") == "IQ4_XS"
    assert quant_in_name("plain.gguf") is None


def kvchat(*args: str, home: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "KVCHAT_HOME": str(home / "kvchat")}
    return subprocess.run(
        [sys.executable, "-m", "kvchat", *args],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip


def test_the_models_command_lists_every_store_and_says_why_one_does_not_run(stores, tmp_path):
    home = Path(os.environ["HOME"])
    settings = home / "kvchat" / "config" / "settings.toml"
    refused = stores["folder"] / "not-a-llama"
    shutil.copytree(stores["folder"] / "my-llama", refused)
    config = json.loads((refused / "config.json").read_text())
    (refused / "config.json").write_text(json.dumps({**config, "model_type": "falcon_h1"}))
    done = kvchat("models", home=home)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].split() == ["name", "source", "format", "size", "quant", "architecture", "runs"]
    row = next(line.split() for line in lines if line.startswith("tiny:2m "))
    assert row[1:3] == ["ollama", "gguf"] and row[-3:] == ["Q4_1", "llama", "yes"]
    assert any(line.startswith("tiny-org/tiny-llama ") and "hf-cache" in line for line in lines)
    assert "not-a-llama" not in done.stdout  # model_dirs not set yet
    settings.parent.mkdir(parents=True, exist_ok=True)
    settings.write_text(f'model_dirs = ["{stores["folder"]}"]\n')
    (stores["folder"] / "broken.gguf").write_bytes(b"not a model")  # listed, not a traceback
    done = kvchat("models", home=home)
    assert done.returncode == 0 and "Traceback" not in done.stderr
    row = next(line.split() for line in done.stdout.splitlines() if line.startswith("not-a-llama "))
    assert row[1] == "folder" and row[-1] == "no"
    assert "not-a-llama: Unsupported architecture" in done.stdout
    assert "broken: " in done.stdout and "is not a GGUF file" in done.stdout


def test_a_model_named_from_ollamas_store_runs_without_writing_there(stores, tmp_path):
    home = Path(os.environ["HOME"])
    ollama = home / ".ollama" / "models"
    before = sorted((p, p.stat().st_mtime_ns) for p in ollama.rglob("*"))
    done = kvchat(
        "ask", "hi", "--model", "tiny:2m", "--dtype", "float32", "--max-tokens", "4",
        "--device-cache", "16MiB", "--host-cache", "0", "--disk-cache", "0", home=home,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert sorted((p, p.stat().st_mtime_ns) for p in ollama.rglob("*")) == before
    assert "Loading tiny:2m (float32" in done.stderr  # by its name, not its blob's
