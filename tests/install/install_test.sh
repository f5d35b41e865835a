#!/usr/bin/env bash
# `cmake --install` into a scratch root, then: a project outside the tree builds against it with
# find_package(tierd) and with pkg-config; `systemd-analyze verify` accepts the installed unit;
# the installed daemon starts from the installed config; and CPack builds a .deb holding it all.
# Usage: install_test.sh SOURCE_DIR BUILD_DIR
set -euo pipefail
src=$1 build=$2
work=$(mktemp -d /var/tmp/tierd-install-XXXXXX)
trap 'rm -rf "$work"' EXIT
fail() { echo "install_test: $*" >&2; exit 1; }

# 1. cmake --install under a root, with the package's prefix.
root=$work/root
DESTDIR=$root cmake --install "$build" --prefix /usr >"$work/install.log"
for f in usr/bin/tierd usr/bin/tierctl usr/bin/tierd-bench usr/include/tierd/client.h usr/include/tierd/client.hpp \
         usr/include/tierd/optimizer.hpp usr/lib/systemd/system/tierd.service \
         usr/lib/sysusers.d/tierd.conf etc/tierd/tierd.toml \
         usr/share/tierd/dashboards/tierd-overview.json usr/share/tierd/dashboards/tierd-detail.json \
         usr/share/tierd/prometheus/prometheus.yml usr/share/tierd/prometheus/tierd-rules.yml \
         usr/share/tierd/slurm/train.sbatch usr/share/tierd/slurm/torchrun-node.sh \
         usr/lib/python3/dist-packages/tierd/__init__.py usr/lib/python3/dist-packages/tierd/torch/__init__.py \
         usr/share/doc/tierd/examples/train_gpt.py; do
  [[ -e $root/$f ]] || fail "cmake --install did not install /$f"
done
config=$(find "$root/usr/lib" -name tierdConfig.cmake)
[[ -n $config ]] || fail "no tierdConfig.cmake installed"
libdir=${config%/cmake/tierd/tierdConfig.cmake}
ls "$libdir"/libtierd_client.so.0 >/dev/null || fail "no libtierd_client.so.0 in $libdir"

# 2. find_package(tierd) from a project outside the tree.
cmake -S "$src/tests/install" -B "$work/consumer" -G Ninja -DCMAKE_PREFIX_PATH="$root/usr" \
  -DCMAKE_BUILD_TYPE=Release >"$work/consumer.log" || { cat "$work/consumer.log"; fail "find_package(tierd) failed"; }
cmake --build "$work/consumer" >>"$work/consumer.log" || { cat "$work/consumer.log"; fail "the consumer did not build"; }
LD_LIBRARY_PATH=$libdir "$work/consumer/consumer" "$work/no-daemon-here"

# 3. pkg-config, for C.
pc=$(PKG_CONFIG_SYSROOT_DIR=$root PKG_CONFIG_LIBDIR=$libdir/pkgconfig pkg-config --cflags --libs tierd)
cc -o "$work/consumer_c" "$src/tests/install/consumer.c" $pc
LD_LIBRARY_PATH=$libdir "$work/consumer_c"

# 4. The unit names the prefix's binary and configuration. systemd's own checker reads it from an
# install under a plain prefix (it needs the binary at the path the unit names on this machine).
unit=$root/usr/lib/systemd/system/tierd.service
grep -q "^ExecStart=/usr/bin/tierd --config=/etc/tierd/tierd.toml$" "$unit" || fail "unexpected ExecStart in the unit"
prefix=$work/prefix
cmake --install "$build" --prefix "$prefix" >>"$work/install.log"
unit=$prefix/lib/systemd/system/tierd.service
grep -q "^ExecStart=$prefix/bin/tierd --config=$prefix/etc/tierd/tierd.toml$" "$unit" ||
  fail "unexpected ExecStart in the unit under $prefix"
[[ -e $prefix/etc/tierd/tierd.toml ]] || fail "no configuration under $prefix/etc"
out=$(systemd-analyze verify "$unit" 2>&1) || fail "systemd-analyze verify: $out"
[[ -z $out ]] || fail "systemd-analyze verify warns: $out"

# 5. The installed daemon starts from the installed config (paths moved under the scratch root).
cfg=$work/tierd.toml
sed -e "s|^# *socket_dir = .*|socket_dir = \"$work/run\"|" \
    -e "s|^# *state_dir = .*|state_dir = \"$work/state\"|" "$root/etc/tierd/tierd.toml" >"$cfg"
mkdir -p "$work/run"
LD_LIBRARY_PATH=$libdir "$root/usr/bin/tierd" --config="$cfg" --host_capacity=64MiB \
  --host_segment_size=16MiB --lock_memory=false --nvme_regions="$work/r0:256MiB" \
  --device=none --probe_bytes=0 --metrics_listen=127.0.0.1:0 >"$work/daemon.log" 2>&1 &
pid=$!
for _ in $(seq 300); do [[ -S $work/run/tierd.sock ]] && break; sleep 0.1; done
[[ -S $work/run/tierd.sock ]] || { cat "$work/daemon.log"; fail "the installed daemon did not start"; }
LD_LIBRARY_PATH=$libdir "$root/usr/bin/tierctl" --socket_dir="$work/run" health ||
  fail "the installed tierctl finds the installed daemon unhealthy"
# The installed Python package, away from the source tree, loads the installed library (found by
# the dynamic loader) and talks to the installed daemon; tierd.torch imports.
py() { (cd "$work" && env -u TIERD_CLIENT_LIB PYTHONPATH="$root/usr/lib/python3/dist-packages" \
  LD_LIBRARY_PATH="$libdir" /usr/bin/python3 "$@"); }
where=$(py -c 'import tierd, tierd._abi as a; print(tierd.__file__, a.library_path())')
[[ $where == "$root/usr/lib/python3/dist-packages/tierd/__init__.py libtierd_client.so.0" ]] ||
  fail "the installed package is not the one imported, or it does not load the installed library: $where"
status=$(py -m tierd status --socket-dir "$work/run") ||
  fail "python3 -m tierd status from the installed package failed"
grep -q "^host " <<<"$status" || fail "python3 -m tierd status shows no host tier: $status"
if /usr/bin/python3 -c 'import torch' 2>/dev/null; then
  py -c 'import tierd.torch' || fail "the installed tierd.torch does not import"
fi
kill -TERM $pid; wait $pid || { cat "$work/daemon.log"; fail "the installed daemon did not stop cleanly"; }

# 6. The .deb.
(cd "$work" && cpack -B "$work/deb" --config "$build/CPackConfig.cmake" >"$work/cpack.log") ||
  { cat "$work/cpack.log"; fail "cpack failed"; }
deb=$(ls "$work"/deb/tierd_*.deb)
contents=$(dpkg-deb -c "$deb")
for f in ./usr/bin/tierd ./usr/bin/tierctl ./usr/lib/systemd/system/tierd.service \
         ./etc/tierd/tierd.toml ./usr/include/tierd/client.hpp ./usr/lib/sysusers.d/tierd.conf \
         ./usr/lib/python3/dist-packages/tierd/torch/__init__.py; do
  grep -q " $f\$" <<<"$contents" || fail ".deb lacks $f"
done
info=$(dpkg-deb -I "$deb")
grep -q "^ Depends:.*liburing" <<<"$info" || fail ".deb Depends misses liburing: $info"
dpkg-deb -e "$deb" "$work/control"
grep -qx /etc/tierd/tierd.toml "$work/control/conffiles" || fail "the config is not a conffile"
echo "install_test: ok ($(basename "$deb"))"
