#!/usr/bin/env bash
# Builds llama.cpp's llama-server from the sources vendored in the
# llama-cpp-python sdist into .servers/llama-server/ (git-ignored), reusing
# a finished build. Prints the binary's path on its last line.
#
#   benchmarks/servers/build_llama_server.sh [DEST]
#
# The web UI is switched off: its prebuilt bundle would be downloaded at
# build time, and test machines have no route out beyond the package index.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/../.." && pwd)"
DEST="${1:-$ROOT/.servers/llama-server}"
VERSION="0.3.36"
JOBS="${KVCHAT_BUILD_JOBS:-2}"
BIN="$DEST/bin/llama-server"

mkdir -p "$DEST/src"
# one build at a time (a test run and CI, or two test runs, may ask at once)
exec 9>"$DEST/.lock"
flock 9

# The CPU's own SIMD features, named one by one rather than -march=native: a
# virtual machine may list amx_tile while its kernel refuses the tile state, and
# a native build then dies of an illegal instruction at start. AMX stays off.
CPU_FLAGS=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2) "
SIMD=(-DGGML_NATIVE=OFF)
for pair in avx:AVX avx2:AVX2 fma:FMA f16c:F16C bmi2:BMI2 avx512f:AVX512 \
  avx512_vbmi:AVX512_VBMI avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16 avx_vnni:AVX_VNNI; do
  if [[ "$CPU_FLAGS" == *" ${pair%%:*} "* ]]; then
    SIMD+=("-DGGML_${pair##*:}=ON")
  else
    SIMD+=("-DGGML_${pair##*:}=OFF")
  fi
done
SIMD+=(-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF)
STAMP="${SIMD[*]}"

# reused only when built for this CPU's features (the checkout may move between machines);
# it is run as its users run it, with its libraries found beside it: the build tree its
# RPATH names may be gone (a build made in another checkout, then copied here)
if [ -x "$BIN" ] && [ "$(cat "$DEST/bin/simd" 2>/dev/null)" = "$STAMP" ] \
  && LD_LIBRARY_PATH="$DEST/bin" "$BIN" --version >/dev/null 2>&1; then
  echo "$BIN"
  exit 0
fi
cd "$DEST/src"
if [ ! -f "llama_cpp_python-$VERSION.tar.gz" ]; then
  python3 -m pip download -q --no-binary :all: --no-deps "llama-cpp-python==$VERSION" -d . >&2
fi
if [ ! -d "llama_cpp_python-$VERSION" ]; then
  tar xzf "llama_cpp_python-$VERSION.tar.gz"
fi
SRC="$DEST/src/llama_cpp_python-$VERSION/vendor/llama.cpp"
GENERATOR=()
if command -v ninja >/dev/null 2>&1; then GENERATOR=(-G Ninja); fi
nice -n 15 cmake -S "$SRC" -B "$DEST/build" "${GENERATOR[@]}" \
  -DLLAMA_BUILD_SERVER=ON "${SIMD[@]}" -DLLAMA_USE_PREBUILT_UI=OFF \
  -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_CURL=OFF -DCMAKE_BUILD_TYPE=Release >&2
nice -n 15 cmake --build "$DEST/build" --target llama-server -j"$JOBS" >&2

# The binary loads libllama/libggml from beside it (its RPATH points into the
# build tree); copy both so the build tree could be removed.
mkdir -p "$DEST/bin"
cp -a "$DEST/build/bin/." "$DEST/bin/"
find "$DEST/build" -name '*.so*' -exec cp -a {} "$DEST/bin/" \;
"$BIN" --version >&2 || LD_LIBRARY_PATH="$DEST/bin" "$BIN" --version >&2
echo "$STAMP" > "$DEST/bin/simd"
echo "$BIN"
