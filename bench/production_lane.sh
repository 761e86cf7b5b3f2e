#!/usr/bin/env bash
# The production tier on one CUDA GPU, one case per process (docs/PRODUCTION.md; the results
# go to docs/GPU_RESULTS.md). Each case runs `dsv4-oracle check --catalog production --case ID`
# with the oracle and the comparisons on the GPU, under its own time limit, so a case that is
# cut off or runs out of memory costs only itself. Per case: $OUT/<id>.log (the summary table),
# $OUT/<id>/report.json (every check), and one line in $OUT/summary.tsv (case, exit status,
# wall seconds, peak host memory in GiB). Run from the repository root with torch (CUDA) and, for
# the cuDNN backend, nvidia-cudnn-frontend importable (pip install -e '.[test,gpu]').
#   CASES="prod-flash-T4096 prod-pro-T4096"   default: every production case, smallest first
#   IMPL=gpu_impl:cudnn   CASE_TIMEOUT=540   REPLAYS=3
set -o pipefail
OUT=${OUT:-/tmp/production-lane}
IMPL=${IMPL:-gpu_impl:cudnn}
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [ -z "${CASES:-}" ]; then
  CASES=$(python3 -m dsv4_oracle.cli check --catalog production --list | awk 'NF > 1 {print $1}' |
          grep '^prod-' | sort -t T -k 2 -n -s)
fi
[ -f "$OUT/summary.tsv" ] || printf 'case\texit\twall_s\tpeak_rss_gib\n' > "$OUT/summary.tsv"
for id in $CASES; do
  start=$(date +%s.%N)
  /usr/bin/time -f '%M' -o "$OUT/$id.rss" timeout "${CASE_TIMEOUT:-540}" \
    python3 -m dsv4_oracle.cli check --catalog production --case "$id" --impl "$IMPL" \
      --oracle-device cuda --replays "${REPLAYS:-3}" --no-progress --report "$OUT/$id" \
      > "$OUT/$id.log" 2>&1
  rc=$?
  wall=$(python3 -c "import time; print(round(time.time() - $start, 1))")
  rss=$(python3 -c "print(round(int(open('$OUT/$id.rss').read().split()[-1]) / 2**20, 2))" 2>/dev/null || echo '?')
  printf '%s\t%s\t%s\t%s\n' "$id" "$rc" "$wall" "$rss" | tee -a "$OUT/summary.tsv"
done
