#!/usr/bin/env bash
# kvchat on a GPU, checked in one run of at most ~5 minutes (benchmarks/gpu_check.py says what).
#
#   benchmarks/gpu_check.sh --prepare   here, with network: wheels of kvchat and of the
#                                       dependencies the GPU machine may lack, into
#                                       build/gpu_check/ (a few MiB; the device tool carries
#                                       at most 64 MiB)
#   benchmarks/gpu_check.sh             on the GPU machine (no network, its own torch): installs
#                                       the wheels it lacks with --no-deps into a scratch folder,
#                                       then runs the check and prints one summary
#   benchmarks/gpu_check.sh --dry-run   the same checks on the CPU at tiny sizes
#
# Extra arguments go to gpu_check.py (e.g. --skip bench).
set -euo pipefail
cd "$(dirname "$0")/.."
WHEELS=build/gpu_check
PYTHON=${PYTHON:-python3}
# modules the check imports beyond torch, and the distribution that provides each
DEPS="safetensors:safetensors tokenizers:tokenizers jinja2:jinja2 markupsafe:markupsafe platformdirs:platformdirs"

if [[ "${1:-}" == "--prepare" ]]; then
    rm -rf "$WHEELS" && mkdir -p "$WHEELS"
    "$PYTHON" -m pip wheel --quiet --no-deps --no-build-isolation -w "$WHEELS" .
    for dep in $DEPS; do
        # binary wheels for the Pythons a GPU image may have (abi3 ones serve them all)
        for py in 3.10 3.11 3.12 3.13; do
            "$PYTHON" -m pip download --quiet --no-deps --only-binary :all: \
                --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
                --python-version "$py" -d "$WHEELS" "${dep#*:}" || true
        done
    done
    du -sh "$WHEELS"
    ls "$WHEELS"
    exit 0
fi

DRY=""
[[ "${1:-}" == "--dry-run" ]] && DRY=1
SITE=$(mktemp -d /tmp/kvchat-gpu-check-site-XXXX)
trap 'rm -rf "$SITE"' EXIT
if [[ -d "$WHEELS" ]]; then
    missing=()
    for dep in $DEPS; do
        "$PYTHON" -c "import ${dep%%:*}" 2>/dev/null || missing+=("${dep#*:}")
    done
    if [[ -z "$DRY" ]]; then missing+=(kvchat); fi  # the dry run checks this checkout
    if ((${#missing[@]})); then
        echo "gpu_check: installing ${missing[*]} from $WHEELS (--no-deps)"
        "$PYTHON" -m pip install --quiet --no-deps --no-index --find-links "$WHEELS" \
            --target "$SITE" "${missing[@]}"
    fi
elif [[ -z "$DRY" ]]; then
    echo "gpu_check: no $WHEELS here: using this checkout's kvchat and the installed packages"
fi
# the wheels first; then this checkout (the dry run, or a kvchat wheel that did not install)
export PYTHONPATH="$SITE${PYTHONPATH:+:$PYTHONPATH}:$PWD"
# Inductor's compiled kernels stay in the scratch folder: a rerun in the same session reuses them
export TORCHINDUCTOR_CACHE_DIR=${TORCHINDUCTOR_CACHE_DIR:-/tmp/kvchat-gpu-check-compiled}
# on a GPU the check must end within the device time a session gets; a CPU dry run may be slow
if [[ -n "$DRY" ]]; then exec "$PYTHON" benchmarks/gpu_check.py "$@"; fi
exec timeout 290 "$PYTHON" benchmarks/gpu_check.py "$@"
