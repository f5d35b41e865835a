#!/usr/bin/env bash
# The Python package's tests on torch 2.x, without a GPU: Debian 13's python3-torch (2.6, Python
# 3.13) in a chroot, against the GPU kit's daemon, tierctl and client library (which need nothing
# there but glibc). GPU machines run torch 2.x, Debian 12 has 1.13: this runs the torch 2.x paths
# (torch.distributed.checkpoint, untyped storages, post-accumulate-grad hooks) on any machine.
#
#   tests/torch2/run.sh BUILD_DIR [PYTEST_ARGS...]     (as root: debootstrap, chroot, mounts)
#   tests/torch2/run.sh BUILD_DIR -- COMMAND...        (a command there instead, a bench say;
#                                                      the kit is /opt/tierd/tierd-gpu-kit)
#
# The chroot is made once, by debootstrap from $TIERD_TORCH2_MIRROR (deb.debian.org by default),
# under $TIERD_TORCH2_ROOT (BUILD_DIR/torch2-root by default; about 2.5 GB), and kept for later
# runs. Without PYTEST_ARGS it runs the torch tests: optimizer, semantics, two ranks, streaming,
# two nodes and checkpoints.
set -euo pipefail
build=$(cd "$1" && pwd)
shift
src=$(cd "$(dirname "$0")/../.." && pwd)
root=${TIERD_TORCH2_ROOT:-$build/torch2-root}
mirror=${TIERD_TORCH2_MIRROR:-http://deb.debian.org/debian}
packages=python3,python3-torch,python3-pytest,python3-numpy,python3-yaml

if [[ $(id -u) != 0 ]]; then
  exec sudo --preserve-env=TIERD_TORCH2_ROOT,TIERD_TORCH2_MIRROR "$0" "$build" "$@"
fi
if [[ ! -x "$root/usr/bin/python3" ]] || ! chroot "$root" python3 -c 'import torch' 2>/dev/null; then
  command -v debootstrap >/dev/null || { echo "torch2: debootstrap is missing (make deps)" >&2; exit 1; }
  echo "torch2: making a Debian 13 chroot with python3-torch in $root"
  if findmnt -rn -o TARGET | grep -q "^$root/"; then
    echo "torch2: something is mounted under $root: unmount it first" >&2
    exit 1
  fi
  rm -rf "$root"
  log="$root.debootstrap.log"
  if ! debootstrap --variant=minbase --include="$packages" trixie "$root" "$mirror" >"$log" 2>&1; then
    tail -n 30 "$log" >&2
    echo "torch2: debootstrap failed (its log: $log)" >&2
    exit 1
  fi
fi
cp /etc/hosts "$root/etc/hosts"  # the ranks' rendezvous goes through this machine's name
site=$(chroot "$root" python3 -c 'import site; print(site.getsitepackages()[0])')
cp "$src/tests/torch2/no_libuv.py" "$root$site/tierd_no_libuv.py"
echo "import tierd_no_libuv" >"$root$site/tierd_no_libuv.pth"

# The kit (the CUDA build's binaries and the Debian 12 libraries they load) and the sources the
# tests read, fresh each run.
work="$root/opt/tierd"
rm -rf "$work"
mkdir -p "$work"
"$src/tests/gpu/make_kit.sh" "$build" "$work" >/dev/null
rm "$work/tierd-gpu-kit.tar.gz"
cp -a "$src/python" "$src/examples" "$src/deploy" "$src/bench" "$work/"
mkdir -p "$work/tests"
cp -a "$src/tests/python" "$work/tests/"

if [[ $# == 0 ]]; then
  set -- tests/python/test_torch_optimizer.py tests/python/test_torch_semantics.py \
    tests/python/test_torch_zero.py tests/python/test_streaming.py tests/python/test_multinode.py
fi
cat >"$work/inside.sh" <<'INSIDE'
#!/bin/bash
kit=/opt/tierd/tierd-gpu-kit
export TIERD_BIN=$kit/daemon/tierd TIERD_CLIENT_LIB=$kit/client/libtierd_client.so.0 \
  TIERCTL_BIN=$kit/tools/tierctl
cd /opt/tierd
python3 -c 'import sys, torch; print("torch2: python", sys.version.split()[0], "torch", torch.__version__)'
if [[ "${1:-}" == -- ]]; then
  shift
  exec "$@"
fi
exec python3 -m pytest -q -p no:cacheprovider "$@"
INSIDE
chmod +x "$work/inside.sh"
# A mount namespace of its own: the chroot's mounts go when the run ends, however it ends.
exec unshare --mount --propagation private env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root \
  LANG=C.UTF-8 bash -c 'root=$1; shift
    mount -t proc proc "$root/proc" && mount --rbind /dev "$root/dev" &&
    exec chroot "$root" /opt/tierd/inside.sh "$@"' torch2 "$root" "$@"
