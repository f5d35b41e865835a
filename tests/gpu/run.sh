#!/usr/bin/env bash
# On a CUDA machine: builds tierd with CUDA required, runs the GPU tests and the GPU benchmarks,
# and prints the figures (record them in docs/benchmarks.md with the date and the device).
#
#   tests/gpu/run.sh [BUILD_DIR]        (default build-gpu)
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build-gpu}
nvidia-smi --query-gpu=name,uuid,memory.total,driver_version --format=csv || true
cmake -S . -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTIERD_CUDA=ON >/dev/null
cmake --build "$build" -j "$(nproc)"
"$build/tests/gpu/tierd_gpu_tests"
"$build/bench/tierd-bench" pcie --device=cuda
"$build/bench/tierd-bench" pcie --device=cuda --json
"$build/bench/tierd-bench" gpu-adam
"$build/bench/tierd-bench" gpu-adam --json
