#!/usr/bin/env bash
# Installs the Debian packages that tierd's build, tests and demo need, and nothing else.
# Idempotent: when every package is present it only runs dpkg-query and exits.
set -euo pipefail

packages=(
  build-essential cmake ninja-build pkg-config ccache clang libclang-rt-14-dev
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev libspdlog-dev libfmt-dev liburing-dev libtomlplusplus-dev
  libxxhash-dev libsystemd-dev libcivetweb-dev libdlpack-dev prometheus-cpp-dev prometheus systemd
  nlohmann-json3-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  python3 python3-venv python3-pytest python3-numpy python3-yaml python3-tqdm python3-grpcio
  python3-protobuf python3-setuptools python3-wheel
  fio patchelf libaio-dev
)

missing=()
for p in "${packages[@]}"; do
  status=$(dpkg-query -W -f='${Status}' "$p" 2>/dev/null || true)
  [[ "$status" == "install ok installed" ]] || missing+=("$p")
done

if [[ ${#missing[@]} -eq 0 ]]; then
  exit 0
fi

echo "install-deps: installing ${missing[*]}"
sudo=""
if [[ $(id -u) -ne 0 ]]; then
  command -v sudo >/dev/null || { echo "install-deps: not root and no sudo; install: ${missing[*]}" >&2; exit 1; }
  sudo="sudo"
fi
export DEBIAN_FRONTEND=noninteractive
$sudo apt-get update -qq
$sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
