"""Writes a Hugging Face folder of a GGUF model, for servers that load only such folders (vLLM).

    python benchmarks/servers/hf_from_gguf.py MODEL.gguf OUT_DIR

transformers keeps a GGUF's quantized weights packed and refuses to save such a
model, so the weights are dequantized on load and copied into a plain model built
from the same config, which saves normally (its chat template goes to
`chat_template.jinja`). Skips the work when OUT_DIR already holds a finished copy.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path


def convert(gguf: Path, out: Path) -> Path:
    done = out / "config.json"
    if done.exists():
        return out
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GgufConfig

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


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    print(convert(Path(sys.argv[1]), Path(sys.argv[2])))
