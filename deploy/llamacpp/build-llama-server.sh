#!/usr/bin/env bash
# Build llama.cpp's `llama-server` from the llama.cpp source vendored in the llama-cpp-python sdist on PyPI,
# and cache the binary outside the repository so it is built once per machine (about 5 minutes on 2 cores).
#
# Usage: deploy/llamacpp/build-llama-server.sh        prints the path of the cached binary
# Env:   SKYLB_CACHE (default ~/.cache/skylb), LLAMA_CPP_PYTHON_VERSION (default 0.3.36), PYTHON (default python3)
set -euo pipefail
cache="${SKYLB_CACHE:-$HOME/.cache/skylb}"
version="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
python="${PYTHON:-python3}"
bin="$cache/llama-server-$version/bin/llama-server"
if [ -x "$bin" ]; then echo "$bin"; exit 0; fi

command -v cmake >/dev/null || { apt-get update -qq && apt-get install -y -qq cmake >&2; }
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
"$python" -m pip download --quiet --no-deps --no-binary :all: -d "$work" "llama-cpp-python==$version" >&2
tar xzf "$work"/llama_cpp_python-*.tar.gz -C "$work"
src="$(echo "$work"/llama_cpp_python-*/vendor/llama.cpp)"
cmake -S "$src" -B "$work/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DGGML_NATIVE=OFF \
  -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF >&2
cmake --build "$work/build" --target llama-server -j"$(nproc)" >&2
mkdir -p "$(dirname "$bin")"
cp "$work/build/bin/llama-server" "$bin.tmp" && mv "$bin.tmp" "$bin"
echo "$bin"
