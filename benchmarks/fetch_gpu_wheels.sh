#!/usr/bin/env bash
# Fetch the wheels spec needs on a bare GPU machine (Python 3.12, x86-64 Linux, no network) into
# benchmarks/gpu_wheels/, for benchmarks/gpu_check.sh to install there. That machine already has torch,
# triton, numpy, transformers, tokenizers, safetensors, typer, rich, httpx and pytest, with their own
# dependencies; only what spec needs beyond them is fetched, and the folder travels with the working
# tree (64 MiB in all), so nothing heavy may come in.
#
#     bash benchmarks/fetch_gpu_wheels.sh        # needs PyPI; prints the folder's size
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
DEST="${GPU_WHEELS_DIR:-$ROOT/benchmarks/gpu_wheels}"
PIP="${PIP:-python3 -m pip}"
TARGET=(--only-binary=:all: --python-version 3.12 --implementation cp
        --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux_2_28_x86_64
        -d "$DEST")

# Light packages, with their dependencies: pydantic pins its pydantic-core exactly, fastapi needs
# starlette, and so on; the resolver picks matching versions.
WITH_DEPS=(fastapi uvicorn pydantic prometheus-client psutil sentencepiece protobuf)
# Packages whose own dependencies are heavy and already there (xgrammar: torch, transformers, triton,
# numpy; gguf: numpy, pyyaml, tqdm, requests): fetched alone, with xgrammar's one light dependency
# missing there, apache-tvm-ffi (its native runtime).
NO_DEPS=(gguf xgrammar apache-tvm-ffi)
# Dependencies pulled in above that the machine has through httpx and typer: dropped so that the
# copies installed on PYTHONPATH do not shadow the machine's. typing_extensions stays: pydantic may need
# a newer one than torch brought, and newer ones only add.
ALREADY_THERE='^(anyio|idna|sniffio|click|h11|certifi|httpcore|exceptiongroup)-'

mkdir -p "$DEST"
$PIP download "${TARGET[@]}" "${WITH_DEPS[@]}"
$PIP download "${TARGET[@]}" --no-deps "${NO_DEPS[@]}"
find "$DEST" -maxdepth 1 -name '*.whl' -printf '%f\n' | grep -Ei "$ALREADY_THERE" | while read -r wheel; do
    rm -f "$DEST/$wheel"
done
ls -1 "$DEST"
echo "gpu_wheels: $(du -sh "$DEST" | cut -f1) in $DEST (the working tree and carried paths must fit 64 MiB together)"
