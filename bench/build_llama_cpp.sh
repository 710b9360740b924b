#!/usr/bin/env bash
# Builds llama.cpp's own llama-bench, llama-batched-bench, llama-server and llama-perplexity for this CPU
# from the llama-cpp-python source package (its vendor/llama.cpp): the speed peer of `kvserve bench
# --compare llama.cpp` and the quality peer of `kvserve eval --compare llama.cpp`. Not part of `make
# test`; nothing it writes is committed (build/ is ignored).
#
#   bench/build_llama_cpp.sh [DEST]      # DEST defaults to build/llama.cpp; ~20 minutes on 2 cores
#
# LLAMA_CMAKE_ARGS adds cmake options after ours, e.g. a build for another instruction set than this CPU's:
#   LLAMA_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON" \
#       bench/build_llama_cpp.sh build/llama.cpp-avx2
#
# The binaries land in DEST/bin; `kvserve bench --compare llama.cpp` looks there (and in
# $KVSERVE_LLAMA_CPP_BIN) before falling back to llama-cpp-python.
set -euo pipefail
here="$(cd "$(dirname "$0")/.." && pwd)"
dest="${1:-$here/build/llama.cpp}"
python="${PYTHON:-$here/.venv/bin/python}"
[ -x "$python" ] || python=python3
mkdir -p "$dest/src"
if [ ! -d "$dest/src/vendor/llama.cpp" ] && [ -d "$here/build/llama.cpp/src/vendor/llama.cpp" ]; then
    cp -r "$here/build/llama.cpp/src/." "$dest/src/"  # the source package another build already unpacked
fi
if [ ! -d "$dest/src/vendor/llama.cpp" ]; then
    tmp="$(mktemp -d)"
    "$python" -m pip download --quiet --no-binary :all: --no-deps -d "$tmp" llama-cpp-python
    tar -xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$dest/src" --strip-components=1
    rm -rf "$tmp"
fi
command -v cmake >/dev/null || "$python" -m pip install --quiet cmake
cmake -S "$dest/src/vendor/llama.cpp" -B "$dest/cmake" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=ON -DLLAMA_BUILD_TOOLS=ON \
    -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF ${LLAMA_CMAKE_ARGS:-} >"$dest/cmake.log"
cmake --build "$dest/cmake" -j "$(nproc)" --target llama-bench llama-batched-bench llama-server llama-perplexity >>"$dest/cmake.log"
mkdir -p "$dest/bin"
for tool in llama-bench llama-batched-bench llama-server llama-perplexity; do
    cp "$(find "$dest/cmake" -name "$tool" -type f -perm -u+x | head -1)" "$dest/bin/"
done
"$dest/bin/llama-bench" --help >/dev/null
echo "built: $dest/bin (llama-bench, llama-batched-bench, llama-server, llama-perplexity)"
