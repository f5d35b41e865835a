#!/usr/bin/env bash
# The GPU checks, ordered by what they are worth when GPU time is short: equality on the device
# first, then the TFLOPS runs, then the rest; each step under its own time limit (and the run under
# --budget), each writing its log (and its figures, as JSON, as it goes) to an output folder.
#
# Runs from an unpacked GPU kit (`make gpu-kit`: nothing to build, no -dev packages needed) or from
# the source tree, where it uses (and, if missing, builds) a CUDA build folder.
#
#   tests/gpu/run.sh [--out=DIR] [--device=cuda|emulated] [--build=DIR] [--python=PY]
#                    [--budget=SECONDS] [--list] [STEP...]
#
#   --out=DIR    where logs and figures go (default: gpu-results-<date> in the current folder)
#   --device=    the daemons' device backend (default cuda; emulated checks the kit without a GPU)
#   --build=DIR  source tree only: the CUDA build folder (default build)
#   --python=PY  the Python with torch that the torch steps run (default: $TIERD_PYTHON, else
#                python3); a Python without torch skips those steps, saying so
#   --budget=S   the whole run's time: a step is cut to what is left, and one that would get
#                under 30 s is not run (`not-run` in summary.json)
#   STEP...      run only these steps (default: all, in order); --list names them
#
# Exit status: 0 when every step passed, was skipped or was not run for the budget, 1 when one
# failed or ran out of time.
set -uo pipefail

root=$(cd "$(dirname "$0")/../.." && pwd)
steps_all=(environment torch-equality torch-stream tflops torch-train torch gpu-tests pcie gpu-adam
           doctor)
out="gpu-results-$(date +%Y%m%d-%H%M%S)"
build=""
device=cuda
python=${TIERD_PYTHON:-python3}
budget=0
steps=()
for arg in "$@"; do
  case "$arg" in
    --out=*) out=${arg#--out=} ;;
    --build=*) build=${arg#--build=} ;;
    --device=cuda|--device=emulated) device=${arg#--device=} ;;
    --python=*) python=${arg#--python=} ;;
    --budget=*) budget=${arg#--budget=} ;;
    --list) printf '%s\n' "${steps_all[@]}"; exit 0 ;;
    -h|--help) sed -n 2,23p "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
    -*) echo "run.sh: unknown option $arg (see --help)" >&2; exit 2 ;;
    *)
      if [[ " ${steps_all[*]} " != *" $arg "* ]]; then
        echo "run.sh: unknown step '$arg'; steps: ${steps_all[*]}" >&2
        exit 2
      fi
      steps+=("$arg") ;;
  esac
done
[[ ${#steps[@]} -eq 0 ]] && steps=("${steps_all[@]}")
mkdir -p "$out"
out=$(cd "$out" && pwd)

# The binaries: a kit keeps them at the build tree's relative paths, beside lib/ (their RUNPATHs
# find it).
if [[ -x "$root/daemon/tierd" ]]; then
  bin=$root
else
  bin=$(cd "$root" && mkdir -p "${build:-build}" && cd "${build:-build}" && pwd)
  if [[ ! -x "$bin/tests/gpu/tierd_gpu_tests" ]]; then
    echo "== building $bin (CUDA required)"
    cmake -S "$root" -B "$bin" -G Ninja -DCMAKE_BUILD_TYPE=RelWithDebInfo -DTIERD_CUDA=ON \
      >"$out/build.log" 2>&1 && cmake --build "$bin" -j "$(nproc)" >>"$out/build.log" 2>&1 || {
      echo "build failed: $out/build.log"; tail -20 "$out/build.log"; exit 1; }
  fi
fi
export TIERD_CLIENT_LIB="$bin/client/libtierd_client.so.0"
# Daemons the steps start get a private folder each; nothing is left behind in /tmp.
scratch=$(mktemp -d "${TMPDIR:-/tmp}/tierd-gpu-XXXXXX")
trap 'rm -rf "$scratch"' EXIT

run_environment() {
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  uname -a
  ldd --version 2>&1 | head -1
  nvidia-smi --query-gpu=name,uuid,memory.total,driver_version,pcie.link.gen.current,pcie.link.width.current \
    --format=csv 2>&1 || echo "nvidia-smi: not available"
  echo "memlock limit: $(ulimit -l)"
  echo "cpus: $(nproc); memory: $(awk '/MemTotal/ {print $2 " kB"}' /proc/meminfo)"
  [[ -f "$root/KIT" ]] && cat "$root/KIT"
  "$python" -c 'import sys, torch; print("python", sys.version.split()[0], "torch", torch.__version__, "cuda", torch.cuda.is_available())' 2>&1 ||
    echo "python: $python has no torch: the torch steps skip (--python=PY names another)"
  # A daemon's start-up log says which fallbacks it chose (io_uring, memlock, CUDA, huge pages).
  local dir="$scratch/env"
  mkdir -p "$dir"
  "$bin/daemon/tierd" --socket_dir="$dir" --state_dir="$dir/state" --device="$device" \
    --device_capacity=512MiB --device_segment_size=256MiB --host_capacity=512MiB \
    --host_segment_size=256MiB --nvme_regions="$dir/nvme.region:1GiB" \
    --metrics_listen=127.0.0.1:0 >"$dir/log" 2>&1 &
  local pid=$! i
  for i in $(seq 1 300); do [[ -S "$dir/tierd.sock" ]] && break; sleep 0.1; done
  kill -TERM "$pid" 2>/dev/null; wait "$pid"
  local rc=$?
  echo "daemon exited $rc; its log:"
  cat "$dir/log"
  if [[ $rc -ge 128 ]] && command -v cuda-gdb >/dev/null; then
    # A crash: once more under a debugger, for the stack.
    rm -rf "$dir" && mkdir -p "$dir"
    (for i in $(seq 1 300); do [[ -S "$dir/tierd.sock" ]] && break; sleep 0.1; done
     pkill -TERM -f "socket_dir=$dir" ) &
    cuda-gdb -batch -ex "handle SIGTERM nostop noprint pass" -ex run -ex "thread apply all bt 20" \
      --args "$bin/daemon/tierd" --socket_dir="$dir" --state_dir="$dir/state" --device=cuda \
      --device_capacity=512MiB --device_segment_size=256MiB --host_capacity=512MiB \
      --host_segment_size=256MiB --nvme_regions="$dir/nvme.region:1GiB" \
      --metrics_listen=127.0.0.1:0 2>&1 | grep -v "^\[New Thread\|^\[Thread .* exited" | tail -80
    return 1
  fi
  [[ $rc -eq 0 ]]
}
run_doctor() {
  local args=(doctor --regions="$scratch/doctor.region" --host_capacity=1GiB)
  "$bin/tools/tierctl" --json "${args[@]}" >"$out/doctor.json"
  "$bin/tools/tierctl" "${args[@]}"
}
run_gpu-tests() { "$bin/tests/gpu/tierd_gpu_tests" --gtest_output="json:$out/gpu-tests.json"; }
run_pcie() {
  "$bin/bench/tierd-bench" pcie --device="$device" --dir="$scratch" --json | tee "$out/pcie.json"
}
run_gpu-adam() { "$bin/bench/tierd-bench" gpu-adam --json | tee "$out/gpu-adam.json"; }
# The torch steps need a Python with torch: without one they are skipped (77), saying which
# Python was tried, rather than failing on an import.
with_torch() {
  if ! "$python" -c 'import torch' >/dev/null 2>&1; then
    echo "skipped: $python cannot import torch (give --python=PY or TIERD_PYTHON)"
    return 77
  fi
}
run_torch() {
  with_torch || return
  TIERD_BIN="$bin/daemon/tierd" "$python" "$root/tests/gpu/torch_cuda.py" --json="$out/torch.json"
}

run_torch-train() {
  with_torch || return
  "$python" "$root/tests/gpu/torch_train.py" --build="$bin" --json="$out/torch-train.json"
}

run_torch-stream() {
  with_torch || return
  "$python" "$root/tests/gpu/torch_stream.py" --build="$bin" --json="$out/torch-stream.json"
}

# Streamed models trained as in the device's memory, case by case (on the emulated device: the
# CPU).
run_torch-equality() {
  with_torch || return
  local on=cpu
  [[ $device == cuda ]] && on=cuda
  "$python" "$root/tests/gpu/torch_equality.py" --build="$bin" --device="$on" \
    --json="$out/torch-equality.json"
}

# The example GPT at 6.4 B parameters (32 blocks of d 4096), bf16, through a device budget of
# about a quarter of its weights at 8 K tokens a step, the optimizer split between the lanes by
# measured rates, then all on the CPU; its fp32 state (72 GiB) in a 96 GiB host tier and its
# weights' two versions (24 GiB) on NVMe (a 128 GiB machine whose 64 GiB disk cannot hold the
# state). Each step's TFLOPS is printed as it comes. On the emulated device, the same command on
# a model of 2 small blocks.
run_tflops() {
  with_torch || return
  local size=(--layers 32 --d-model 4096 --heads 32 --ctx 8192 --prefetch 5
              --state-home host --host-capacity 96GiB --nvme-region 40GiB --steps 3)
  local on=cuda
  if [[ $device != cuda ]]; then
    on=cpu
    size=(--layers 2 --d-model 64 --heads 4 --ctx 64 --host-capacity 256MiB --nvme-region 1GiB
          --steps 2)
  elif ! "$python" -c 'import torch, sys; sys.exit(not torch.cuda.is_available())'; then
    echo "skipped: torch sees no GPU"
    return 77
  fi
  # The optimizer split by measured rates with the device share's state kept on the device
  # (40 GiB: all of half the fp32 state, in a 56 GiB device tier); the same with the model in
  # the GPU's memory instead of streamed (the ideal the stream is measured against); the state
  # sent home each step; then all on the CPU.
  local kept=(--device-budget $((40 << 30)) --device-capacity 56GiB)
  [[ $on == cuda ]] || kept=(--device-budget $((64 << 20)))
  local lanes args
  for lanes in kept in-memory auto cpu; do
    case $lanes in
      kept) args=(--device-share auto "${kept[@]}") ;;
      in-memory) args=(--device-share auto "${kept[@]}" --in-memory) ;;
      auto) args=(--device-share auto) ;;
      cpu) args=() ;;
    esac
    echo "-- optimizer: $lanes"
    PYTHONUNBUFFERED=1 "$python" "$root/bench/param_stream.py" --scale --build "$bin" \
      --device "$on" --dtype bfloat16 --batch 1 "${size[@]}" "${args[@]}" || return
  done
}

declare -A limit=([environment]=90 [torch-equality]=150 [torch-stream]=540 [tflops]=420
                  [torch-train]=540 [torch]=150 [gpu-tests]=300 [pcie]=240 [gpu-adam]=240
                  [doctor]=120)
began=$(date +%s)
failed=0
summary="$out/summary.json"
echo "[" >"$summary"
first=1
for step in "${steps[@]}"; do
  step_limit=${limit[$step]}
  if [[ $budget -gt 0 ]]; then
    left=$(( budget - ($(date +%s) - began) ))
    (( left < step_limit )) && step_limit=$left
  fi
  [[ $first -eq 1 ]] || echo "," >>"$summary"
  first=0
  if (( step_limit < 30 )); then
    echo "== $step: not-run (the budget has $step_limit s left)"
    printf '{"step":"%s","result":"not-run","exit":0,"seconds":0}' "$step" >>"$summary"
    continue
  fi
  echo "== $step (limit $step_limit s)"
  start=$(date +%s%N)
  # Each step in its own process group, killed whole at its limit.
  timeout -k 10 "$step_limit" bash -c "set -o pipefail; $(declare -f "run_$step" with_torch); $(declare -p bin out root scratch device python); run_$step" \
    >"$out/$step.log" 2>&1
  rc=$?
  took=$(( ($(date +%s%N) - start) / 1000000000 ))
  tail -40 "$out/$step.log"
  case $rc in
    0) result=passed ;;
    77) result=skipped ;;
    124|137) result=timeout; failed=1 ;;
    *) result=failed; failed=1 ;;
  esac
  echo "== $step: $result (exit $rc, ${took} s)"
  printf '{"step":"%s","result":"%s","exit":%d,"seconds":%s}' "$step" "$result" "$rc" "${took:-0}" >>"$summary"
done
echo "]" >>"$summary"
echo "logs and figures: $out"
exit $failed
