#!/usr/bin/env bash
# Builds llama.cpp's llama-server (with llama-bench and llama-quantize beside it) from
# the sources vendored in the llama-cpp-python sdist into the servers cache, reusing a
# finished build. Prints the server binary's path on its last line.
#
#   benchmarks/servers/build_llama_server.sh [DEST]
#
# The servers cache is one folder per user, outside any checkout, shared by the
# tests, the benchmarks and CI: KVCHAT_SERVERS_DIR, else
# ${XDG_CACHE_HOME:-~/.cache}/kvchat-servers. kvchat/testing/servers_dir.py gives
# the same folder (this script runs without kvchat installed): keep the two in sync.
# The build goes to llama-server-VERSION-KEY/ in it, KEY a hash of the CPU features it
# was built for (bin/simd names them), so machines sharing a home each keep their own
# build; only bin/ is kept (the binary and the libraries it loads from beside it).
#
# The web UI is switched off: its prebuilt bundle would be downloaded at
# build time, and test machines have no route out beyond the package index.
set -euo pipefail
SERVERS="${KVCHAT_SERVERS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvchat-servers}"
VERSION="0.3.36"
JOBS="${KVCHAT_BUILD_JOBS:-2}"

# The CPU's own SIMD features, named one by one rather than -march=native: a
# virtual machine may list amx_tile while its kernel refuses the tile state, and
# a native build then dies of an illegal instruction at start. AMX stays off.
CPU_FLAGS=" $(grep -m1 '^flags' /proc/cpuinfo 2>/dev/null | cut -d: -f2) "
# KVCHAT_LLAMA_CPU=avx2 builds what an AVX2 laptop runs (AVX2, FMA, F16C; no AVX-512),
# the peer of kvchat on an emulated AVX2 CPU: the CPU's features are capped at those.
if [ "${KVCHAT_LLAMA_CPU:-native}" = "avx2" ]; then
  CPU_FLAGS=" $(for f in avx avx2 fma f16c bmi2; do
    [[ "$CPU_FLAGS" == *" $f "* ]] && printf '%s ' "$f"; done)"
elif [ "${KVCHAT_LLAMA_CPU:-native}" != "native" ]; then
  echo "KVCHAT_LLAMA_CPU is native or avx2, not ${KVCHAT_LLAMA_CPU}" >&2
  exit 2
fi
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
KEY="$(printf '%s' "$STAMP" | sha256sum | cut -c1-12)"

DEST="${1:-$SERVERS/llama-server-$VERSION-$KEY}"
BIN="$DEST/bin/llama-server"

mkdir -p "$DEST"
# one build at a time (a test run and CI, or two test runs, may ask at once)
exec 9>"$DEST/.lock"
flock 9

# reused only when built for this CPU's features (DEST given by hand may have moved
# between machines); it is run as its users run it, with its libraries found beside it:
# the build tree its RPATH names is removed once a build is done
if [ -x "$BIN" ] && [ -x "$DEST/bin/llama-quantize" ] \
  && [ "$(cat "$DEST/bin/simd" 2>/dev/null)" = "$STAMP" ] \
  && LD_LIBRARY_PATH="$DEST/bin" "$BIN" --version >/dev/null 2>&1; then
  echo "$BIN"
  exit 0
fi
mkdir -p "$DEST/src"
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
# llama-bench too: the bench's llama.cpp figures (tg128, pp512) come from it; and
# llama-quantize, which makes the bench's 4-bit files of model shapes (Q4_0, Q4_K_M)
nice -n 15 cmake --build "$DEST/build" --target llama-server llama-bench llama-quantize \
  -j"$JOBS" >&2

# The binary loads libllama/libggml from beside it (LD_LIBRARY_PATH=bin; its RPATH
# points into the build tree); copy both, then remove the build tree and the sources,
# which are most of the folder's size and are not needed to run it.
mkdir -p "$DEST/bin"
cp -a "$DEST/build/bin/." "$DEST/bin/"
find "$DEST/build" -name '*.so*' -exec cp -a {} "$DEST/bin/" \;
LD_LIBRARY_PATH="$DEST/bin" "$BIN" --version >&2
echo "$STAMP" > "$DEST/bin/simd"
rm -rf "$DEST/build" "$DEST/src"
echo "$BIN"
