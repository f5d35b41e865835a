#!/usr/bin/env bash
# Packs a CUDA build into the GPU kit: one archive that runs tests/gpu/run.sh on a machine with a
# CUDA driver and glibc at least as new as the one recorded in KIT, and nothing else installed.
#
#   tests/gpu/make_kit.sh BUILD_DIR OUT_DIR      (writes OUT_DIR/tierd-gpu-kit.tar.gz)
#
# The binaries keep the build tree's relative layout (the tests find the daemon by it), stripped of
# debug information. Every shared library they load comes along in lib/ — Debian's own gRPC,
# protobuf, abseil, spdlog, fmt, liburing, civetweb, prometheus-cpp, toml++, xxhash and their
# dependencies — except glibc, libstdc++ and libgcc_s, which the host provides. RUNPATHs are $ORIGIN-relative, so the
# unpacked kit works from any folder.
set -euo pipefail
build=$(cd "$1" && pwd)
out=$(mkdir -p "$2" && cd "$2" && pwd)
src=$(cd "$(dirname "$0")/../.." && pwd)
kit="$out/tierd-gpu-kit"
rm -rf "$kit"
mkdir -p "$kit"/{daemon,tools,bench,client,tests/gpu,tests/python,python,lib}

binaries=(daemon/tierd tools/tierctl bench/tierd-bench tests/gpu/tierd_gpu_tests)
for b in "${binaries[@]}"; do
  [[ -x "$build/$b" ]] || { echo "make_kit: $build/$b is missing (a CUDA build: -DTIERD_CUDA=ON)" >&2; exit 1; }
  objcopy --strip-debug "$build/$b" "$kit/$b"
done
client=$(readlink -f "$build/client/libtierd_client.so.0")
objcopy --strip-debug "$client" "$kit/client/libtierd_client.so.0"
cp "$src/tests/gpu/run.sh" "$src/tests/gpu/torch_cuda.py" "$src/tests/gpu/torch_train.py" \
  "$src/tests/gpu/torch_stream.py" "$src/tests/gpu/torch_equality.py" "$kit/tests/gpu/"
cp "$src/tests/python/tierd_abi.py" "$kit/tests/python/"
mkdir -p "$kit/python/tierd/torch"
cp "$src"/python/tierd/*.py "$kit/python/tierd/"
cp "$src"/python/tierd/torch/*.py "$kit/python/tierd/torch/"
cp "$src/bench/adam_torch.py" "$src/bench/train_step.py" "$src/bench/activation_offload.py" \
  "$src/bench/param_stream.py" "$src/bench/benchlib.py" "$src/bench/deepspeed_side_by_side.py" \
  "$kit/bench/"
mkdir -p "$kit/examples"
cp "$src/examples/train_gpt.py" "$kit/examples/"

# Every library the binaries load, by the paths this machine resolves them to.
. "$src/deploy/bundle-libs.sh"
LD_LIBRARY_PATH="$kit/client" bundle_libraries "$kit/lib" "${binaries[@]/#/$kit/}" \
  "$kit/client/libtierd_client.so.0"

# RUNPATH relative to each file's own folder.
for b in "${binaries[@]}"; do
  up=$(dirname "$b" | sed 's|[^/]*|..|g')
  patchelf --set-rpath "\$ORIGIN/$up/lib:\$ORIGIN/$up/client" "$kit/$b"
done
patchelf --set-rpath '$ORIGIN/../lib' "$kit/client/libtierd_client.so.0"
for l in "$kit"/lib/*.so*; do patchelf --set-rpath '$ORIGIN' "$l"; done

# The newest glibc and libstdc++ symbol versions anything in the kit needs.
everything=("${binaries[@]/#/$kit/}" "$kit"/client/*.so* "$kit"/lib/*.so*)
glibc=$(newest_symbol_version GLIBC "${everything[@]}")
libstdcxx=$(newest_symbol_version GLIBCXX "${everything[@]}")
{
  echo "tierd GPU kit"
  echo "version: $(cd "$src" && git describe --always --dirty 2>/dev/null || echo unknown)"
  echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(. /etc/os-release && echo "$PRETTY_NAME")"
  echo "needs: glibc >= ${glibc#GLIBC_}, libstdc++ with ${libstdcxx}, a CUDA driver for CUDA $(
    /usr/local/cuda/bin/nvcc --version | sed -n 's/.*release \([0-9.]*\).*/\1/p') or newer"
  echo "run: tests/gpu/run.sh --out=DIR [STEP...]   (steps: tests/gpu/run.sh --list)"
} >"$kit/KIT"
tar -C "$out" -czf "$out/tierd-gpu-kit.tar.gz" tierd-gpu-kit
echo "make_kit: $out/tierd-gpu-kit.tar.gz ($(du -h "$out/tierd-gpu-kit.tar.gz" | cut -f1))"
cat "$kit/KIT"
