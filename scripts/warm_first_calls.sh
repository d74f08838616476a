#!/usr/bin/env bash
# First calls in fresh processes, cold then warm twice, for each workload and backend, each
# backend with its own fresh cache directories:
#   scripts/warm_first_calls.sh DEVICE "nanogpt nanogpt_train" "inductor tilefuse" > log
# Prints the `== ... first call` line of each process (scripts/first_call_phases.py), and for a
# process that printed none, its last lines (the error that stopped it). PHASES="cold warm"
# runs one warm process instead of two.
device=$1; workloads=$2; backends=$3
for w in $workloads; do
  for b in $backends; do
    c=$(mktemp -d)
    for phase in ${PHASES:-cold warm warm}; do
      echo -n "$phase "
      out=$(TORCHINDUCTOR_CACHE_DIR=$c/ind TRITON_CACHE_DIR=$c/triton TILEFUSE_CACHE_DIR=$c/tf \
        PYTHONPATH=src python scripts/first_call_phases.py "$w" "$b" "$device" 2>&1)
      if ! grep "^== " <<<"$out"; then
        echo "== $w $b failed:"
        tail -n 8 <<<"$out" | sed 's/^/     /'
      fi
    done
    rm -rf "$c"
  done
done
