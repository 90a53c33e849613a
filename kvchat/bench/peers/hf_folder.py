"""A Hugging Face folder of a GGUF model, for a peer that loads only such folders (vLLM).

transformers keeps a GGUF's quantized weights packed and refuses to save such a
model, so the weights are dequantized on load and copied into a plain model built
from the same config, which saves normally (its chat template goes to
`chat_template.jinja`). A finished folder is reused.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from kvchat.bench.peers.base import PeerUnavailable


def hf_folder_of(gguf: Path | str, out: Path | str) -> Path:
    """`out`, written from `gguf` unless a finished copy is there; PeerUnavailable if not."""
    gguf, out = Path(gguf), Path(out)
    if (out / "config.json").exists():
        return out
    try:
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GgufConfig
    except ImportError as exc:
        raise PeerUnavailable(
            f"writing a Hugging Face folder of {gguf.name} needs transformers, gguf and "
            f"accelerate (pip install 'kvchat[bench]'): {exc}"
        ) from None
    folder, name = str(gguf.parent), gguf.name
    packed = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, quantization_config=GgufConfig(dequantize=True), dtype="bfloat16"
    )
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype="bfloat16")
    plain.load_state_dict(packed.state_dict(), strict=False)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    plain.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)  # a crash never leaves a half-written folder that looks finished
    return out
