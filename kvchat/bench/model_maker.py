"""The bench's models of real shape, made once and kept in a cache folder.

Asked for a shape (`model_shapes`), the bench makes it once: seeded random weights from
transformers' `from_config` in bf16, in a child process with a memory cap (transformers'
memory is not kept by the bench, and a shape too big for the machine fails there, not
in the bench), written as safetensors with the default model's tokenizer; converted by
llama.cpp's `convert_hf_to_gguf.py` to a bf16 GGUF; quantized by `llama-quantize` to
each of `QUANTS`; the safetensors and the bf16 GGUF then removed. Every engine reads the
same file: kvchat and llama.cpp the GGUF, transformers the folder kvchat converts it to.

The files live in `bench-models/` of kvchat's cache folder (never in a checkout), one
folder a shape, written under a temporary name and renamed when whole; `kvchat bench
--list-shapes` lists them with their sizes and `--remove-shape NAME` removes one.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from kvchat.bench import llama_cpp_tools
from kvchat.bench.model_shapes import QUANTS, SHAPES, ModelShape
from kvchat.errors import KvchatError, UsageError
from kvchat.units import format_size

MIN_FREE_DISK = 15 * 10**9  # the least free disk a shape is made with, whatever its size
SEED = 0
CHILD_TIMEOUT_S = 3600


@dataclass(frozen=True)
class MadeShape:
    """A shape's files in the cache."""

    name: str
    folder: Path
    size: int  # bytes of every file

    def gguf(self, quant: str) -> Path:
        return self.folder / f"{self.name}-{quant}.gguf"

    @property
    def hf_folder(self) -> Path:
        return self.folder / "hf"


def shapes_dir(cache: Path) -> Path:
    return cache / "bench-models"


def parse_shape(spec: str) -> tuple[ModelShape, str]:
    """`NAME` or `NAME:QUANT` (Q4_K_M unless given): the shape and the quantization."""
    name, _, quant = spec.partition(":")
    quant = (quant or "Q4_K_M").upper()
    if name not in SHAPES:
        raise UsageError(
            f"--model-shape {name!r} is not a shape the bench knows; it knows {', '.join(SHAPES)}."
        )
    if quant not in QUANTS:
        raise UsageError(f"--model-shape takes {', '.join(QUANTS)} after the colon, not {quant}.")
    return SHAPES[name], quant


def made_shapes(cache: Path) -> list[MadeShape]:
    """The shapes made so far (whole ones only)."""
    root = shapes_dir(cache)
    if not root.is_dir():
        return []
    return [
        MadeShape(
            folder.name, folder, sum(f.stat().st_size for f in folder.rglob("*") if f.is_file())
        )
        for folder in sorted(root.iterdir())
        if folder.is_dir() and (folder / "done").exists()
    ]


def remove_shape(cache: Path, name: str) -> MadeShape:
    """Remove a made shape's files; a `UsageError` naming the made ones if there is none."""
    for made in made_shapes(cache):
        if made.name == name:
            shutil.rmtree(made.folder)
            return made
    names = ", ".join(m.name for m in made_shapes(cache)) or "none"
    raise UsageError(f"No shape {name!r} has been made (made: {names}).")


def make_shape(
    shape: ModelShape,
    cache: Path,
    default_tokenizer: Path,
    progress: Callable[[str], None],
    *,
    llama_server: str | None = None,
    tools_cache: Path | None = None,
) -> MadeShape:
    """The shape's files, made now unless they were already (see the module's doc).
    llama.cpp's converter is fetched into `tools_cache` (`cache` unless given)."""
    for made in made_shapes(cache):
        if made.name == shape.name:
            return made
    quantizer = llama_cpp_tools.find_quantize(llama_server)  # before any long work
    weights = parameter_count(shape) * 2  # bf16
    check_room(shape, weights, shapes_dir(cache))
    final = shapes_dir(cache) / shape.name
    partial = shapes_dir(cache) / f".{shape.name}.partial"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    made = MadeShape(shape.name, partial, 0)
    try:
        progress(f"Making {shape.name} ({format_size(weights)} of random bf16 weights), once...")
        write_random_weights(
            shape, made.hf_folder, default_tokenizer, memory_cap=3 * weights + 8 * 2**30
        )
        progress(f"Converting {shape.name} with llama.cpp's convert_hf_to_gguf.py...")
        bf16 = partial / f"{shape.name}-bf16.gguf"
        llama_cpp_tools.convert(
            made.hf_folder, bf16, "bf16", tools_cache or cache, shape.convert_options
        )
        for quant in QUANTS:
            progress(f"Quantizing {shape.name} to {quant} with llama-quantize...")
            llama_cpp_tools.quantize(bf16, made.gguf(quant), quant, quantizer)
        bf16.unlink()
        shutil.rmtree(made.hf_folder)  # 2 bytes a weight, read by nothing once converted
        (partial / "done").write_text(f"{shape.describes}, seed {SEED}\n")
    except BaseException:  # a failed or interrupted make leaves no GBs of half a model
        shutil.rmtree(partial, ignore_errors=True)
        raise
    partial.rename(final)
    return next(m for m in made_shapes(cache) if m.name == shape.name)


def parameter_count(shape: ModelShape) -> int:
    """The shape's weights, counted on the meta device (nothing allocated)."""
    import torch
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(shape.transformers_config())
    return sum(p.numel() for p in model.parameters())


def check_room(shape: ModelShape, weight_bytes: int, where: Path) -> None:
    """Refuse, saying why, when the disk or the memory is too short for the shape."""
    where.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(where).free
    needed_disk = max(MIN_FREE_DISK, 3 * weight_bytes)  # safetensors + bf16 GGUF + 4-bit files
    if free < needed_disk:
        raise KvchatError(
            f"Making {shape.name} needs {format_size(needed_disk)} of free disk in {where}; "
            f"there is {format_size(free)}. Free some, or remove made shapes "
            "(kvchat bench --list-shapes, --remove-shape NAME)."
        )
    available = _available_memory()
    needed_memory = 2 * weight_bytes
    if available is not None and available < needed_memory:
        raise KvchatError(
            f"Making {shape.name} needs about {format_size(needed_memory)} of memory; "
            f"{format_size(available)} is available. Close other programs or pick a smaller "
            "shape."
        )


def _available_memory() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


_CHILD = """
import json, resource, sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from kvchat.bench.model_shapes import ModelShape

name, config_class, config, out, tokenizer = sys.argv[1:6]
cap, seed = int(sys.argv[6]), int(sys.argv[7])
resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
torch.manual_seed(seed)
config = ModelShape(name, name, config_class, json.loads(config)).transformers_config()
model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
model.save_pretrained(out, safe_serialization=True)
path = __import__("pathlib").Path(tokenizer)
AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name).save_pretrained(out)
from kvchat.bench.model_maker import fill_vocabulary
fill_vocabulary(__import__("pathlib").Path(out) / "tokenizer.json", config.vocab_size)
"""


def fill_vocabulary(tokenizer_json: Path, vocab_size: int) -> int:
    """Give the borrowed tokenizer as many tokens as the shape has embedding rows, so the
    file is the real model's size where it costs most (the embeddings, and a tied head):
    llama.cpp's converter cuts a Gemma's embeddings to the tokenizer's length, and
    llama.cpp refuses a file whose embeddings and vocabulary disagree. The added entries
    are plain vocabulary no merge produces, so text tokenizes as before. Returns how many
    were added."""
    data = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    vocab: dict[str, int] = data["model"]["vocab"]
    taken = set(vocab.values()) | {t["id"] for t in data.get("added_tokens", [])}
    missing = [i for i in range(vocab_size) if i not in taken]
    for i in missing:
        vocab[f"<filler_{i}>"] = i
    tokenizer_json.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    return len(missing)


def write_random_weights(
    shape: ModelShape, out: Path, default_tokenizer: Path, *, memory_cap: int
) -> None:
    """Seeded random bf16 weights of `shape` and the default model's tokenizer (read from
    its GGUF) into `out`, in a child process whose address space is capped. The child is
    given the shape itself (not its name), so a shape need not be one of `SHAPES`."""
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, shape.name, shape.config_class, json.dumps(shape.config),
         str(out), str(default_tokenizer), str(memory_cap), str(SEED)],
        capture_output=True, text=True, timeout=CHILD_TIMEOUT_S,
    )  # fmt: skip
    if done.returncode != 0:
        raise KvchatError(
            f"Making {shape.name}'s weights failed (a memory cap of {format_size(memory_cap)}):"
            f"\n{done.stderr[-2000:]}"
        )
