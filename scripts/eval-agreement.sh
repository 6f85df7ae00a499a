#!/usr/bin/env bash
# Greedy agreement and KL of sparse decoding against dense, on the bundled
# demo document and the 6 continuation prompts of
# tests/data/demo/agreement_prompts.json (the first is the README demo's),
# 64 tokens each, teacher-forced. Starts its own ctxcached on loopback (temp
# data dir), builds the context once per index-param set, prints one JSON
# line per (index params, method, session params) and a summary.
#
#   scripts/eval-agreement.sh [--method M] [--index-param csa.K=V ...] [--param K=V ...]
#
# Needs a Release build in build/ (cmake --build build --target ctxcached ctxcache).
# MODEL_DIR (default: models) is the folder holding ctxcache-ref/, to score
# other weights, e.g. a training run's (docs/history.md).
set -euo pipefail
cd "$(dirname "$0")/.."
METHOD=csa
MODEL_DIR="${MODEL_DIR:-models}"
IDX=()
PARAMS=()
while [ $# -gt 0 ]; do
  case "$1" in
    --method) METHOD="$2"; shift 2 ;;
    --index-param) IDX+=(--index-param "$2"); shift 2 ;;
    --param) PARAMS+=(--param "$2"); shift 2 ;;
    *) echo "unknown argument $1; expected --method, --index-param or --param" >&2; exit 2 ;;
  esac
done
WORK="$(mktemp -d /tmp/ctxcache-eval-XXXXXX)"
PID=""
cleanup() {
  [ -n "$PID" ] && kill -TERM "$PID" 2>/dev/null && wait "$PID" 2>/dev/null || true
  rm -rf "$WORK"
}
trap cleanup EXIT
./build/bin/ctxcached --data-dir "$WORK/data" --listen 127.0.0.1:0 --metrics-listen 127.0.0.1:0 \
  --model-dir "$MODEL_DIR" --default-model ctxcache-ref --port-file "$WORK/ports" >"$WORK/log" 2>&1 &
PID=$!
for _ in $(seq 1 300); do [ -s "$WORK/ports" ] && break; sleep 0.1; done
[ -s "$WORK/ports" ] || { echo "ctxcached did not start:"; cat "$WORK/log"; exit 1; }
S="127.0.0.1:$(sed -n 1p "$WORK/ports")"
INDEX="$METHOD"
case "$METHOD" in oracle|full|streaming) INDEX=csa ;; esac
OUT="$(./build/bin/ctxcache --server "$S" build --file tests/data/demo/document.txt --name eval \
  --index "$INDEX" "${IDX[@]}" 2>/dev/null | tail -1)"
C="$(echo "$OUT" | sed -n 's/^\(built\|reused existing\) context \([0-9a-f]\{32\}\):.*/\2/p')"
[ -n "$C" ] || { echo "build failed: $OUT"; exit 1; }
# The prompts (also train.py eval's sparse-fidelity proxy): a JSON list.
mapfile -d '' PROMPTS < <(python3 -c '
import json, sys
sys.stdout.write("".join(p + "\0" for p in json.load(open(sys.argv[1]))))' \
  tests/data/demo/agreement_prompts.json)
: >"$WORK/runs.jsonl"
for P in "${PROMPTS[@]}"; do
  ./build/bin/ctxcache --server "$S" --timeout 120 --json generate --context "$C" --prompt "$P" \
    --method "$METHOD" --rho 0.05 --max-tokens 64 --compare full --model-dir "$MODEL_DIR" \
    "${PARAMS[@]}" >>"$WORK/runs.jsonl"
done
python3 - "$WORK/runs.jsonl" "$METHOD" "${IDX[*]:-}" "${PARAMS[*]:-}" <<'PY'
import json, sys
runs = [json.loads(l) for l in open(sys.argv[1])]
a = [r["agreement"] for r in runs]
k = [r["mean_kl"] for r in runs]
print(json.dumps({"method": sys.argv[2], "index_params": sys.argv[3], "session_params": sys.argv[4],
                  "prompts": len(runs), "agreement_demo_prompt": a[0],
                  "agreement_mean": sum(a) / len(a), "agreement_min": min(a),
                  "mean_kl": sum(k) / len(k),
                  "bytes_ratio_vs_dense": runs[0]["bytes_ratio_vs_dense"]}))
PY
