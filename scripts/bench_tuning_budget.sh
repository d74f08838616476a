#!/usr/bin/env bash
# The graph tuning budget on a GPU: zoo models at 2 layers compiled cold (fresh caches, new
# processes) and warm, with the budget (the default) or without (`TILEFUSE_TUNING_BUDGET_MS=0`),
# Inductor beside them; each run's own compile cache, so that per-call times reflect its choices.
#   OUT=dir WORKLOADS=nanogpt,nanogpt_train BUDGETS="2000 0" PEERS=inductor bash scripts/bench_tuning_budget.sh
export PYTHONPATH=$PWD/src:$PWD/scripts:$PWD/tests PYTHONUNBUFFERED=1
WORKLOADS=${WORKLOADS:-nanogpt,nanogpt_train,hf_llama}
for budget in ${BUDGETS:-2000 0}; do
  backends=tilefuse
  [ -n "${PEERS-inductor}" ] && backends="${PEERS-inductor},tilefuse"
  TILEFUSE_CACHE_DIR="$(mktemp -d)" TILEFUSE_TUNING_BUDGET_MS=$budget timeout ${LIMIT:-280} \
    python -m tilefuse.bench --group models --workloads "$WORKLOADS" --layers 2 --backends "$backends" \
      --no-sweep --no-memory --compile-latency --quiet --out "$OUT/budget_$budget" 2>&1 | tail -25
done
