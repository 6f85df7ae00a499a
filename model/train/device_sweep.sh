#!/bin/bash
# Several continued-training variants at once, one per GPU, on a multi-GPU
# machine (device kind nvidia-h100-x4: four GPUs for the device time of one).
# Each variant is device_run.sh's tune with its own state folder $R/NAME, GPU
# and a few flags appended to the shared recipe (TUNE_MORE / TUNE_TASK_MORE:
# a repeated train.py flag, the last one wins). Runs from the repository root.
#   start:  unpack the init model and the carried held-out text once, start
#           every variant (prep, then training in the background), report
#           progress until ~STOP_AT seconds.
#   wait:   report progress until every variant is DONE or ~STOP_AT seconds;
#           then finish in the same call when that leaves time (FINISH_BEFORE).
#   finish: device_run.sh finish for every variant at once (each on its GPU),
#           their evaluations to $OUT/NAME/ (pack.tar: train.py eval's files,
#           log, summary), a table of the 16K accuracy, and the weights of the
#           best variant (most 16K tasks right; TAKE=NAME picks another).
#   take NAME: a variant's weights to $OUT/NAME/, in the evalsaved layout
#           (xz'd shards, config, index, and the init's tokenizer, docs.tsv,
#           heldout.txt.xz and unigram_counts.npy): a later tune's TUNE_INIT.
# VARIANTS: one "NAME|TUNE_TASK_MORE|TUNE_MORE" per line (the default below).
# TINY=1: the same on the CPU with device_run.sh's tiny model (TUNE_INIT
# defaults to the dry run's saved model), R=model/train/work/sweep-tiny.
set -e
export PYTHONUNBUFFERED=1
T0=$(date +%s)
STOP_AT=${STOP_AT:-570}
FINISH_BEFORE=${FINISH_BEFORE:-330}
if [ "${TINY:-0}" = 1 ]; then
  R=${R:-model/train/work/sweep-tiny}
  TUNE_INIT=${TUNE_INIT:-model/train/work/tiny/saved}
  STOP_AT=${STOP_AT_TINY:-$STOP_AT}
else
  R=${R:-/root/sweep}
  TUNE_INIT=${TUNE_INIT:-model/train/work/run7c}
fi
# Shared by every variant, after device_run.sh's tune recipe (run 7's).
SWEEP_TASK_MORE=${SWEEP_TASK_MORE:-"--task-seed 9"}
if [ "${TINY:-0}" = 1 ]; then SWEEP_MORE=${SWEEP_MORE:-}; else
  SWEEP_MORE=${SWEEP_MORE:-"--minutes 17"}; fi
# Run 8 (session 15): does run 7's recipe keep its gains and win var_track
# back with more time (r7), or do var_track's questions about the distractor
# chain cause its collapse (nodist); and two ways to more answers per token.
VARIANTS=${VARIANTS:-"r7||
nodist|--no-distractor-questions|
nodist-k8|--no-distractor-questions --extra-questions 8|
nodist-tf07|--no-distractor-questions|--task-frac 0.7"}
C=model/train/work/carry
mkdir -p $R
export TUNE_INIT

names() { echo "$VARIANTS" | cut -d'|' -f1; }
field() { echo "$VARIANTS" | awk -F'|' -v n="$1" -v f="$2" '$1 == n {print $f}'; }
gpu_of() { names | grep -nx "$1" | cut -d: -f1 | awk '{print $1 - 1}'; }
env_of() {  # the environment device_run.sh runs one variant with
  echo "W=$R/$1 OUT=$R/$1/out CUDA_VISIBLE_DEVICES=$(gpu_of $1)"
}
run_for() {  # run_for NAME CMD: device_run.sh CMD for variant NAME
  local n=$1; shift
  env W=$R/$n OUT=$R/$n/out CUDA_VISIBLE_DEVICES=$(gpu_of $n) \
    TUNE_TASK_MORE="$SWEEP_TASK_MORE $(field $n 2)" TUNE_MORE="$SWEEP_MORE $(field $n 3)" \
    bash model/train/device_run.sh "$@"
}
report() {
  for n in $(names); do
    local s="running"
    [ -f $R/$n/run/DONE ] && s="DONE"
    if ! [ -f $R/$n/run/DONE ] && ! kill -0 $(cat $R/$n/train.pid 2>/dev/null || echo 0) 2>/dev/null; then
      s="NOT RUNNING"; fi
    echo "$n [$s] $(run_for $n progress 2>/dev/null | tail -1)"
  done
}
all_done() { for n in $(names); do [ -f $R/$n/run/DONE ] || return 1; done; }
any_dead() {
  for n in $(names); do
    [ -f $R/$n/run/DONE ] && continue
    kill -0 $(cat $R/$n/train.pid 2>/dev/null || echo 0) 2>/dev/null || return 0
  done
  return 1
}
wait_loop() {
  local last=0
  while [ $(( $(date +%s) - T0 )) -lt $STOP_AT ] && ! all_done; do
    if any_dead; then echo "a variant's training is gone:"; report
      for n in $(names); do tail -5 $R/$n/train.log 2>/dev/null | cut -c1-300; done; exit 1; fi
    if [ $(( $(date +%s) - last )) -ge 120 ]; then
      echo "--- $(( $(date +%s) - T0 )) s"; report; last=$(date +%s); fi
    sleep 10
  done
  echo "--- $(( $(date +%s) - T0 )) s"; report
}
do_start() {
  [ "${TINY:-0}" = 1 ] || nvidia-smi --query-gpu=index,name,memory.used --format=csv,noheader
  # Once here, not in each variant at the same time.
  bash scripts/unpack-models.sh . "$TUNE_INIT"
  if [ -f $TUNE_INIT/heldout.txt.xz ] && [ ! -f $TUNE_INIT/heldout.txt ]; then
    xz -dc $TUNE_INIT/heldout.txt.xz > $TUNE_INIT/heldout.txt.tmp
    mv $TUNE_INIT/heldout.txt.tmp $TUNE_INIT/heldout.txt; fi
  if [ ! -f $C/heldout.txt ] && [ -f $C/heldout.txt.xz ]; then
    xz -dc $C/heldout.txt.xz > $C/heldout.txt.tmp && mv $C/heldout.txt.tmp $C/heldout.txt; fi
  local pids=""
  for n in $(names); do
    rm -rf $R/$n && mkdir -p $R/$n
    # STOP_AT=0: tune preps, starts the training in the background and returns.
    (STOP_AT=0 run_for $n tune > $R/$n.tune.log 2>&1) &
    pids="$pids $!"
    echo "started $n: $(env_of $n), task +[$SWEEP_TASK_MORE $(field $n 2)]," \
      "train +[$SWEEP_MORE $(field $n 3)]"
  done
  local bad=0
  for p in $pids; do wait $p || bad=1; done
  for n in $(names); do grep -E '"tasks"|answers|training started' $R/$n.tune.log | cut -c1-250; done
  if [ $bad = 1 ]; then
    for n in $(names); do echo "== $n"; tail -8 $R/$n.tune.log | cut -c1-300; done
    echo "a variant failed to start"; exit 1; fi
  echo "all started after $(( $(date +%s) - T0 )) s"
  wait_loop
}
summary16k() {  # one line per variant: its 16K accuracy by family
  for n in $(names); do
    [ -f $R/$n/eval/eval.json ] || { echo "$n: no eval.json"; continue; }
    python3 - $n $R/$n/eval/eval.json <<'PYEOF'
import json, sys
e = json.load(open(sys.argv[2]))
by = e["tasks"]["by"]
fams = ("niah_single", "niah_multi", "kv_table", "var_track", "section_copy")
k16 = [by.get(f"family:{f}/length:16384", [0, 0])[0] for f in fams]
print(json.dumps({"variant": sys.argv[1], "correct": by["all"][0], "of": by["all"][1],
                  "16K": k16, "16K_sum": sum(k16),
                  "by_family": {f: by.get(f"family:{f}", [0, 0])[0] for f in fams},
                  "ppl": {n: round(p["ppl"], 2) for n, p in e["perplexity"].items()}}))
PYEOF
  done
}
do_take() {
  local n=$1 d=$OUT/$1
  [ -d $R/$n/run/final ] || { echo "take: no $R/$n/run/final"; exit 1; }
  mkdir -p $d
  for f in $R/$n/run/final/*.safetensors; do xz -T0 -6 -c $f > $d/$(basename $f).xz; done
  cp $R/$n/run/final/config.json $R/$n/run/final/model.safetensors.index.json $d/
  for f in tokenizer.model docs.tsv heldout.txt.xz unigram_counts.npy; do
    [ -f $TUNE_INIT/$f ] && cp $TUNE_INIT/$f $d/; done
  echo "take: $n -> \$OUT/$n ($(du -sh $d | cut -f1))"
}
do_finish() {
  local pids=""
  for n in $(names); do
    (run_for $n finish > $R/$n.finish.log 2>&1) &
    pids="$pids $!"
  done
  local bad=0
  for p in $pids; do wait $p || bad=1; done
  for n in $(names); do
    mkdir -p $OUT/$n
    cp $R/$n/out/pack.tar $OUT/$n/ 2>/dev/null || { echo "== $n: no pack.tar"; tail -8 $R/$n.finish.log; bad=1; }
    grep -E '"ppl|perplexity|accuracy' $R/$n.finish.log | head -4 | cut -c1-300 || true
  done
  summary16k | tee $OUT/summary16k.jsonl
  local best=${TAKE:-$(python3 -c "
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith('{')]
print(max(rows, key=lambda r: (r['16K_sum'], r['correct']))['variant'] if rows else '')
" $OUT/summary16k.jsonl)}
  [ -n "$best" ] && do_take $best
  echo "finish done after $(( $(date +%s) - T0 )) s"
  return $bad
}
case "$1" in
start) do_start ;;
wait)
  wait_loop
  if all_done && [ $(( $(date +%s) - T0 )) -lt $FINISH_BEFORE ]; then do_finish
  elif all_done; then echo "all DONE: call finish"
  else echo "still training: call wait again"; fi ;;
finish)
  while ! all_done; do
    if any_dead; then report; exit 1; fi
    sleep 5
  done
  do_finish ;;
take) do_take "$2" ;;
report) report; summary16k ;;
*) echo "usage: $0 start|wait|finish|take NAME|report" >&2; exit 2 ;;
esac
