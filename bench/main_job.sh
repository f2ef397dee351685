#!/usr/bin/env bash
# The README's main job in fresh folders, timed (BENCHMARKS 12, 12b, 12d):
#   bash bench/main_job.sh NAME [--hog]
# runs `RIDGEFILL_REGISTRY_BACKEND=local ridgefill tune --study studies/smollm2-135m.yaml` from this checkout with
# RIDGEFILL_WORK, RIDGEFILL_REGISTRY and PREFECT_HOME under /tmp/mj-NAME, and writes the wall time to its log.
# --hog: one busy-looping process beside the job for its whole run (the choice must not follow the load).
set -u
name=$1; hog=${2:-}; code=$(cd "$(dirname "$0")/.." && pwd); d=/tmp/mj-$name
rm -rf "$d"; mkdir -p "$d"; cd "$code"
if [ "$hog" = "--hog" ]; then python3 -c "while True: pass" & hog_pid=$!; fi
start=$(date +%s); echo "start $(date -u +%H:%M:%S) $(git log --oneline -1)" > "$d/log"
RIDGEFILL_WORK=$d/work RIDGEFILL_REGISTRY=$d/registry PREFECT_HOME=$d/prefect PYTHONPATH=$code \
  RIDGEFILL_REGISTRY_BACKEND=local python -m ridgefill.cli tune --study studies/smollm2-135m.yaml >> "$d/log" 2>&1
rc=$?; echo "rc $rc wall $(($(date +%s) - start)) s end $(date -u +%H:%M:%S)" >> "$d/log"
if [ -n "${hog_pid:-}" ]; then kill "$hog_pid"; fi
exit $rc
