#!/usr/bin/env bash
# Runs one fuzzer over its corpus for SECONDS (default 10): the corpus in the tree is read, never
# written; new inputs go to a scratch directory that is removed afterwards, and a crashing input is
# kept in fuzz-crashes/ with the command that reproduces it.
# Usage: run.sh FUZZER CORPUS_DIR [SECONDS]
set -euo pipefail
fuzzer=$1 corpus=$2 seconds=${3:-10}
seconds=${seconds:-10}
scratch=$(mktemp -d /tmp/tierd-fuzz-XXXXXX)
trap 'rm -rf "$scratch"' EXIT
crashes=${TIERD_FUZZ_CRASH_DIR:-$PWD/fuzz-crashes}
mkdir -p "$crashes"
name=$(basename "$fuzzer")
# The rpc target serves real gRPC in process, whose own threads allocate while libFuzzer's
# per-input leak check runs: that check reported objects of gRPC's (a worker thread's, a vector of
# strings) that no rerun of the same input reproduced. Its leaks are checked at exit, and every
# input checks that every byte of every tier comes back.
case "$name" in
  rpc_fuzz) extra=(-detect_leaks=0) ;;
  *) extra=() ;;
esac
if ! "$fuzzer" -max_total_time="$seconds" -timeout=20 -rss_limit_mb=4096 -print_final_stats=1 \
     "${extra[@]}" -artifact_prefix="$crashes/$name-" "$scratch" "$corpus" 2>"$scratch/log"; then
  tail -n 60 "$scratch/log" >&2
  echo "fuzz: $name failed; reproduce with: $fuzzer $crashes/$name-<crash file>" >&2
  exit 1
fi
grep -E "stat::number_of_executed_units|stat::new_units_added" "$scratch/log" | sed "s/^/$name: /"
