#!/usr/bin/env bash
# `make demo`: starts tierd with its built-in defaults (sockets under ./var/run), runs the demo
# client against it, stops the daemon with SIGTERM and prints a summary.
set -euo pipefail
cd "$(dirname "$0")/.."
build=${1:-build}
mkdir -p var/log
log=var/log/tierd.log
socket_dir=var/run

# Built-in defaults, except that a machine without a GPU gets the emulated device (host memory
# standing in for GPU memory, labelled as such) so that the demo shows all three tiers.
flags=()
if [[ ! -e /dev/nvidia0 ]]; then
  flags=(--device=emulated --device_capacity=512MiB)
fi
"$build/daemon/tierd" "${flags[@]}" >"$log" 2>&1 &
daemon=$!
stop_daemon() {
  if kill -0 "$daemon" 2>/dev/null; then
    kill -TERM "$daemon"
    wait "$daemon" || true
  fi
}
trap stop_daemon EXIT

for _ in $(seq 600); do  # pinning a large pool takes a while on a slow machine
  [[ -S $socket_dir/tierd.session.sock && -S $socket_dir/tierd.sock ]] && break
  if ! kill -0 "$daemon" 2>/dev/null; then
    echo "demo: tierd exited during start-up; its log ($log):" >&2
    cat "$log" >&2
    exit 1
  fi
  sleep 0.1
done

echo "== tierd running (pid $daemon), sockets in $socket_dir, log in $log"
status=0
"$build/examples/tierd-demo" "$socket_dir" || status=$?

kill -TERM "$daemon"
daemon_status=0
wait "$daemon" || daemon_status=$?
trap - EXIT
echo "== tierd stopped (exit status $daemon_status); its log:"
sed 's/^/   /' "$log"
if [[ $status -ne 0 || $daemon_status -ne 0 ]]; then
  echo "demo: FAILED (client $status, daemon $daemon_status)" >&2
  exit 1
fi
echo "demo: OK"
