"""Writes a Hugging Face folder of a GGUF model, for servers that load only such folders (vLLM).

    python benchmarks/servers/hf_from_gguf.py MODEL.gguf OUT_DIR   (with kvchat installed)

Skips the work when OUT_DIR already holds a finished copy (kvchat/bench/peers/hf_folder.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

from kvchat.bench.peers.hf_folder import hf_folder_of

if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    print(hf_folder_of(Path(sys.argv[1]), Path(sys.argv[2])))
