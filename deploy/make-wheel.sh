#!/usr/bin/env bash
# Builds the tierd wheel from a build folder: the Python package with the client library and
# every library it loads but glibc, libstdc++ and libgcc_s (deploy/bundle-libs.sh), their RUNPATHs
# $ORIGIN-relative, so the installed package needs nothing else on the machine. Its platform tag
# records the newest glibc it needs (manylinux_2_NN); the Python code runs on any Python >= 3.9.
#
#   deploy/make-wheel.sh BUILD_DIR OUT_DIR [PYTHON]     (writes OUT_DIR/tierd-VERSION-*.whl)
#
# PYTHON (default python3) builds it with its setuptools, offline (no build isolation).
set -euo pipefail
build=$(cd "$1" && pwd)
out=$(mkdir -p "$2" && cd "$2" && pwd)
python=${3:-python3}
src=$(cd "$(dirname "$0")/.." && pwd)
[[ -e "$build/client/libtierd_client.so.0" ]] ||
  { echo "make-wheel: $build/client/libtierd_client.so.0 is missing (make build)" >&2; exit 1; }

stage="$build/wheel-stage"
rm -rf "$stage"
mkdir -p "$stage/tierd/torch" "$stage/tierd/lib"
cp "$src/python/pyproject.toml" "$stage/"
cp "$src"/python/tierd/*.py "$stage/tierd/"
cp "$src"/python/tierd/torch/*.py "$stage/tierd/torch/"
lib="$stage/tierd/libtierd_client.so.0"
objcopy --strip-debug "$(readlink -f "$build/client/libtierd_client.so.0")" "$lib"

. "$src/deploy/bundle-libs.sh"
bundle_libraries "$stage/tierd/lib" "$lib"
patchelf --set-rpath '$ORIGIN/lib' "$lib"
for l in "$stage"/tierd/lib/*.so*; do patchelf --set-rpath '$ORIGIN' "$l"; done

glibc=$(newest_symbol_version GLIBC "$lib" "$stage"/tierd/lib/*.so*)
glibc=${glibc#GLIBC_}
platform="manylinux_${glibc%%.*}_$(cut -d. -f2 <<<"$glibc")_$(uname -m)"
rm -f "$out"/tierd-*.whl
"$python" -m pip wheel --quiet --no-deps --no-build-isolation --no-cache-dir -w "$out" \
  --config-settings=--build-option=--plat-name="$platform" "$stage"
rm -rf "$stage/build" "$stage"/*.egg-info
echo "make-wheel: $(ls "$out"/tierd-*.whl) ($(du -h "$out"/tierd-*.whl | cut -f1); needs glibc >= $glibc)"
