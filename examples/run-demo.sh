#!/usr/bin/env bash
# `make demo`: starts tierd with its built-in defaults (sockets under ./var/run), trains a small
# GPT with its optimizer state in tierd (examples/train_gpt.py), then resumes that training from
# the state tierd kept, trains a deeper one with its weights streamed through a device budget
# smaller than the model, stops the daemon with SIGTERM and prints a summary. The C++ example client
# (build/examples/tierd-demo var/run) is not part of it.
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
python="$(deploy/python-env.sh)/bin/python"  # requirements.txt's torch (made by `make deps`)
export TIERD_CLIENT_LIB="$build/client/libtierd_client.so.0" PYTHONPATH=python
status=0
"$python" examples/train_gpt.py --socket-dir "$socket_dir" --fresh --steps "${DEMO_STEPS:-40}" \
  || status=$?
if [[ $status -eq 0 ]]; then
  echo "== resuming the same training from the state tierd kept"
  "$python" examples/train_gpt.py --socket-dir "$socket_dir" --resume --steps 5 || status=$?
fi
if [[ $status -eq 0 ]]; then
  echo "== a deeper model (12 blocks) whose weights are streamed through an 8 MiB device budget"
  "$python" examples/train_gpt.py --socket-dir "$socket_dir" --fresh --name train-gpt-streamed \
    --layers 12 --stream-parameters --device-budget 8MiB --steps "${DEMO_STREAM_STEPS:-8}" \
    || status=$?
fi
if [[ $status -eq 0 ]]; then
  echo "== a Hugging Face checkpoint: built on meta, streamed from it, LoRA fine-tuned, saved,"
  echo "   and loaded back by transformers and peft"
  "$python" examples/finetune_hf.py --socket-dir "$socket_dir" --out var/finetune \
    --steps "${DEMO_HF_STEPS:-20}" || status=$?
fi

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
