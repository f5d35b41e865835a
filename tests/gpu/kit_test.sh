#!/usr/bin/env bash
# The GPU kit end to end, without a GPU: packs BUILD_DIR's binaries with tests/gpu/make_kit.sh,
# unpacks the archive somewhere else, and runs its tests/gpu/run.sh against the emulated device
# with no build tree or library path to lean on. PYTHON (the project's Python environment) runs
# the torch steps as far as a machine without a GPU lets them: the equality cases and the TFLOPS
# command on the CPU (the emulated device), the cuda-only steps skipped with no GPU seen.
#
#   tests/gpu/kit_test.sh SOURCE_DIR BUILD_DIR PYTHON
set -euo pipefail
src=$1
build=$2
python=$3
work=$(mktemp -d "${TMPDIR:-/tmp}/tierd-kit-test-XXXXXX")
trap 'rm -rf "$work"' EXIT
fail() { echo "kit_test: $*" >&2; exit 1; }

"$src/tests/gpu/make_kit.sh" "$build" "$work/made" >"$work/make.log" 2>&1 ||
  { cat "$work/make.log"; fail "make_kit failed"; }
mkdir "$work/unpacked"
tar -C "$work/unpacked" -xzf "$work/made/tierd-gpu-kit.tar.gz"
kit="$work/unpacked/tierd-gpu-kit"
rm -rf "$work/made"

grep -q "^needs: glibc >= 2\.[0-9]*," "$kit/KIT" || fail "KIT does not record the glibc it needs"
# Relocatable: every RUNPATH is $ORIGIN-relative, and every library resolves inside the kit or
# to the host's glibc, libstdc++ and libgcc_s.
for f in "$kit"/daemon/tierd "$kit"/tools/tierctl "$kit"/bench/tierd-bench \
         "$kit"/tests/gpu/tierd_gpu_tests "$kit"/client/libtierd_client.so.0 "$kit"/lib/*.so*; do
  runpath=$(readelf -d "$f" | sed -n 's/.*(RUNPATH).*\[\(.*\)\]/\1/p')
  [[ -z "$runpath" || "$runpath" == \$ORIGIN* ]] || fail "$f has RUNPATH $runpath"
  deps=$(env -i ldd "$f")
  if grep -q "not found" <<<"$deps"; then fail "$f: $(grep "not found" <<<"$deps")"; fi
  outside=$(awk '$2 == "=>" && $3 ~ /^\// {print $3}' <<<"$deps" | grep -v "^$kit/" |
    grep -Ev '/(libc|libm|libdl|librt|libpthread|libstdc\+\+|libgcc_s)\.so' || true)
  [[ -z "$outside" ]] || fail "$f loads libraries from outside the kit: $outside"
done

# The run itself, from the unpacked kit, with a clean environment.
env -i PATH=/usr/bin:/bin HOME="$work" "$kit/tests/gpu/run.sh" --device=emulated \
  --python="$python" --out="$work/out" --budget=500 environment torch-equality tflops gpu-tests \
  pcie torch torch-train \
  >"$work/run.log" 2>&1 ||
  { cat "$work/run.log"; fail "run.sh failed"; }
cat "$work/out/summary.json"
python3 - "$work/out" <<'PY'
import json, sys
out = sys.argv[1]
steps = {s["step"]: s["result"] for s in json.load(open(f"{out}/summary.json"))}
assert [steps.get(s) for s in ("environment", "torch-equality", "tflops", "gpu-tests", "pcie")] \
    == ["passed"] * 5, steps
cases = [json.loads(l) for l in open(f"{out}/torch-equality.json")]
assert [(c["case"], c["holds"]) for c in cases] == [
    (c, True) for c in ("checkpoint", "lora", "shared-base", "bf16-moments", "device-lane")], cases
tflops = open(f"{out}/tflops.log").read()
assert tflops.count("step 2: loss") == 4 and "device share" in tflops, tflops
assert "weights in the device's memory" in tflops, tflops
kept = [l for l in tflops.splitlines() if "step 2: loss" in l][0]  # the first run keeps its state
assert "state kept on the device 0 B" not in kept and "state kept on the device" in kept, kept
# Skipped without a GPU, once torch was imported from the kit's run of the given Python.
assert steps.get("torch") in ("skipped", "passed"), steps
assert steps.get("torch-train") in ("skipped", "passed"), steps
for step, said in (("torch", "no GPU"), ("torch-train", "torch sees no GPU")):
    log = open(f"{out}/{step}.log").read()
    assert steps[step] == "passed" or said in log, (step, log)
figures = [json.loads(l) for l in open(f"{out}/pcie.json") if l.startswith("{")]
ops = {f["op"] for f in figures}
assert {"h2d", "d2h", "nvme_to_device"} <= ops, ops
assert all(f["value"] > 0 for f in figures), figures
assert "daemon exited 0" in open(f"{out}/environment.log").read()
print("kit_test: passed;", len(figures), "pcie figures")
PY
