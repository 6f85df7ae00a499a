#!/bin/bash
# Several continued-training variants at once, one per GPU, on a multi-GPU
# machine (device kind nvidia-h100-x4 or -x2: several GPUs for the device time of one).
# Each variant is device_run.sh's tune with its own state folder $R/NAME, GPU
# and a few flags appended to the shared recipe (TUNE_MORE / TUNE_TASK_MORE:
# a repeated train.py flag, the last one wins). Runs from the repository root.
#   start:  unpack the init model and the carried held-out text once, start
#           every variant (prep, then training in the background), then wait
#           as below, until ~STOP_AT seconds. With prep (~135 s) + --minutes
#           + evaluation (~200 s) + collect inside STOP_AT, the whole sweep
#           is this one call (run 9: --minutes 3.3, STOP_AT 560), which no
#           gap between calls can lose.
#   wait:   until ~STOP_AT seconds, or until every variant is evaluated or has
#           failed: a variant whose training is DONE is evaluated at once
#           (device_run.sh finish on its GPU, started with setsid so that it
#           runs on between calls). Every call ends by collecting what is
#           finished into $OUT: packs.tar.xz (each evaluated variant's
#           pack.tar, as NAME.tar: train.py eval's files, log, summary),
#           summary16k.jsonl (16K accuracy by family, the sparse-fidelity
#           proxy), and the best evaluated variant's weights (most 16K
#           tasks right among those within SPARSE_MAX_KL; TAKE=NAME picks
#           another), 7 files in all: the device tool returns at most 8.
#           TUNE_INIT=last-best starts from the best variant that the
#           last start on this machine took (run 10 chained three rounds so,
#           one call each, with no weights carried; exit 3 on a fresh machine).
#   take NAME: a variant's weights to $OUT/NAME/: the xz'd shards and
#           small.tar (config, index, and the init's tokenizer, docs.tsv,
#           heldout.txt.xz and unigram_counts.npy); shards plus unpacked
#           small.tar are the evalsaved layout, a later tune's TUNE_INIT.
#   report: the state of every variant, and the evaluated ones' 16K accuracy.
#   stage:  copy the carried training/work/stage/* to $STAGE (kept while the
#           machine stays warm): data that does not fit into start's carry
#           beside the init model and the corpus, e.g. make_corpus.py's
#           train_extra.txt.xz for a variant's "--extra-train $STAGE/...".
#           start checks that every --extra-train file is there (exit 3 if not:
#           a fresh machine, stage again).
# STOP_AT is when the waiting stops, not when the call ends: collect then
# takes up to ~50 s more (packs.tar.xz, each summary line's var_track layout,
# the best weights xz'd), so give the device call timeout_s >= STOP_AT + 60
# (run 12's last call, 25 s past STOP_AT, lost the weights it was taking).
# The machine goes back 30 s after a call ends; a next call that comes later
# gets a fresh machine, where wait/take/report stop at once (exit 3) instead
# of waiting on a sweep that is gone. That lost runs 8 and 9's first attempt
# (3 of ~13 gaps, docs/history.md), so the default is a sweep inside one start call;
# a longer one (stage, start, wait) risks a gap for each extra call.
# VARIANTS: one "NAME|TUNE_TASK_MORE|TUNE_MORE" per line (the default below).
# TINY=1: the same on the CPU with device_run.sh's tiny model (TUNE_INIT
# defaults to the dry run's saved model), R=training/work/sweep-tiny.
set -e
export PYTHONUNBUFFERED=1
T0=$(date +%s)
STOP_AT=${STOP_AT:-560}
# The best variant is taken among those whose sparse-fidelity proxy (train.py
# eval: mean KL(full || oracle top-5%) over scripts/eval-agreement.sh's
# document and prompts, in torch) is at most SPARSE_MAX_KL, else among all
# (with a warning). 0.055: the proxy gave v2 0.028, run 6 0.054, run 7 0.057
# and run 9 0.062, in the order of the C++ csa's KL, and cli_test's agreement
# acceptance passes on run 6 (93.8%), barely on run 7 (90.6%) and fails on
# run 9 (84.4%) (docs/history.md, run 9).
SPARSE_MAX_KL=${SPARSE_MAX_KL:-0.055}
if [ "${TINY:-0}" = 1 ]; then
  R=${R:-training/work/sweep-tiny}
  STAGE=${STAGE:-training/work/stage-tiny}
  TUNE_INIT=${TUNE_INIT:-training/work/tiny/saved}
  STOP_AT=${STOP_AT_TINY:-$STOP_AT}
  PY=${PY:-/usr/bin/python3}  # as device_run.sh's TINY: Debian's, with sentencepiece
else
  PY=${PY:-python3}
  R=${R:-/root/sweep}
  STAGE=${STAGE:-/root/stage}
  # The shipped model: runs 5-9's weights lived in the ignored work/ and were
  # gone by run 10 (docs/history.md, run 10).
  TUNE_INIT=${TUNE_INIT:-models/ctxcache-ref}
fi
# Shared by every variant, after device_run.sh's tune recipe (run 7's).
SWEEP_TASK_MORE=${SWEEP_TASK_MORE:-"--task-seed 17"}
if [ "${TINY:-0}" = 1 ]; then SWEEP_MORE=${SWEEP_MORE:-}; else
  # 3.1 minutes: the whole sweep in one start call with STOP_AT=530 (run 13:
  # four variants prepped by 173 s, trained by 385 s, evaluated by ~640 s: a
  # wait call after start). 60% of the time at 16K (run 12's g1 / g2).
  SWEEP_MORE=${SWEEP_MORE:-"--minutes 3.1 --phase-frac 0.1,0.15,0.6,0.15"}; fi
# Run 13 (docs/history.md "v2 run 13") moved var_track to its chain answer
# (--var-answer chain, longctx_tasks.VAR_ANSWER: " VAR C = VAR B = VAR A = 48213",
# one lookup per answer step, as RULER's variable tracking answers) and shipped
# round 1's cb as v2.3: every family >= 19 of 20 at 16K, with no task to spare in
# three. Its round 2 from cb (r2b / r2d below, task seed 17, section_copy weight
# 3) reached 100 of 100 at 16K, but its weights were lost (the machine went back
# before the take call). The defaults are that round again, from v2.3: the
# next run's margin. Variants: one GPU each (kind nvidia-h100-x2 or larger).
RT="--extra-questions 8 --extra-train $STAGE/train_extra.txt.xz --var-answer chain"
MIX="niah_single:1,niah_multi:3,kv_table:2,section_copy:3"
VARIANTS=${VARIANTS:-"r2b|$RT --family-weights $MIX,var_track:4 --var-distractor-late 0.25|--lr 1.5e-4
r2d|$RT --family-weights $MIX,var_track:6 --var-distractor-late 0.25|--lr 2e-4"}
export TUNE_INIT

names() { echo "$VARIANTS" | cut -d'|' -f1; }
field() { echo "$VARIANTS" | awk -F'|' -v n="$1" -v f="$2" '$1 == n {print $f}'; }
gpu_of() { names | grep -nx "$1" | cut -d: -f1 | awk '{print $1 - 1}'; }
env_of() {  # the environment device_run.sh runs one variant with
  echo "W=$R/$1 OUT=$R/$1/out CUDA_VISIBLE_DEVICES=$(gpu_of $1)"
}
run_for() {  # run_for NAME CMD: device_run.sh CMD for variant NAME
  local n=$1; shift
  env W=$R/$n OUT=$R/$n/out CUDA_VISIBLE_DEVICES="$(gpu_of $n)" \
    TUNE_TASK_MORE="$SWEEP_TASK_MORE $(field $n 2)" TUNE_MORE="$SWEEP_MORE $(field $n 3)" \
    bash training/device_run.sh "$@"
}
alive() { [ -f "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
state_of() {  # training | DONE | evaluating | evaluated | eval failed | training died
  local n=$1
  if [ -f $R/$n/finish.rc ]; then
    [ "$(cat $R/$n/finish.rc)" = 0 ] && echo evaluated || echo "eval failed"
  elif [ -f $R/$n/finish.pid ]; then
    alive $R/$n/finish.pid && echo evaluating || echo "eval failed"
  elif [ -f $R/$n/run/DONE ]; then echo DONE
  elif alive $R/$n/train.pid; then echo training
  else echo "training died"; fi
}
report() {  # one short line per variant
  for n in $(names); do
    local p
    p=$(run_for $n progress 2>/dev/null | tail -1 | python3 -c "
import json, sys
try:
    r = json.loads(sys.stdin.read())
    print(f\"step {r['step']} seq {r['seq']} {r['elapsed_s']}s val {r['val_loss']}\")
except Exception:
    print('-')")
    echo "  $n: $(state_of $n); $p"
  done
}
settled() {  # every variant evaluated, or failed for good
  for n in $(names); do
    case "$(state_of $n)" in training|DONE|evaluating) return 1 ;; esac
  done
}
need_sweep() {
  [ -d $R ] && [ -n "$(ls $R)" ] || { echo "no sweep in $R on this machine: it is a fresh" \
    "machine (the warm one went back between calls), and what ran there is lost"; exit 3; }
}
start_evals() {
  for n in $(names); do
    if [ "$(state_of $n)" = DONE ]; then
      setsid nohup bash training/device_sweep.sh finish1 $n > $R/$n.finish.log 2>&1 < /dev/null &
      echo $! > $R/$n/finish.pid
      echo "$(( $(date +%s) - T0 )) s: $n DONE, evaluating"
    fi
  done
}
wait_loop() {
  # Each variant's evaluation starts as soon as its training is DONE (setsid:
  # it runs on between calls while the machine is warm), and every call ends
  # with collect, so a call that ends leaves what is finished in $OUT.
  local last=0
  while [ $(( $(date +%s) - T0 )) -lt $STOP_AT ]; do
    start_evals
    settled && break
    if [ $(( $(date +%s) - last )) -ge ${REPORT_EVERY:-240} ]; then
      echo "--- $(( $(date +%s) - T0 )) s"; report; last=$(date +%s); fi
    sleep 10
  done
  start_evals
  echo "--- $(( $(date +%s) - T0 )) s"; report
  collect
}
do_stage() {
  mkdir -p $STAGE
  cp training/work/stage/* $STAGE/
  for f in $STAGE/*.xz; do [ -f "$f" ] && xz -t "$f"; done
  ls -la $STAGE
}
need_staged() {  # every --extra-train file the variants name is on this machine
  local p
  for p in $(echo "$SWEEP_TASK_MORE $(echo "$VARIANTS" | cut -d'|' -f2)" |
             grep -o -- '--extra-train [^ ]*' | cut -d' ' -f2 | tr ',' ' '); do
    [ -f "$p" ] || { echo "--extra-train $p is not on this machine: call stage first" \
      "(a fresh machine has lost what was staged)"; exit 3; }
  done
}
do_start() {
  need_staged
  if [ "$TUNE_INIT" = last-best ]; then
    # The next round on the same warm machine: the weights the last start
    # took, copied aside first (a variant of this round may reuse the name).
    local last
    last=$(cat $R/BEST 2>/dev/null || true)
    [ -n "$last" ] && [ -d $R/$last/run/final ] || { echo "TUNE_INIT=last-best:" \
      "no earlier round on this machine (a fresh one: carry the weights instead)"; exit 3; }
    rm -rf $R/.init && cp -r $R/$last/run/final $R/.init
    echo "TUNE_INIT=last-best: $last's weights"
    TUNE_INIT=$R/.init
    export TUNE_INIT
  fi
  if [ "${TINY:-0}" != 1 ]; then
    nvidia-smi --query-gpu=index,name,memory.used --format=csv,noheader
    local gpus
    gpus=$(nvidia-smi -L | wc -l)
    if [ "$(names | wc -l)" -gt $gpus ]; then
      echo "$(names | wc -l) variants for $gpus GPUs: one GPU each (VARIANTS)"; exit 2; fi
  fi
  # Once here (the init model, the carried held-out text), not in each
  # variant's tune at the same time.
  bash training/device_run.sh unpack
  local pids=""
  mkdir -p $R
  for n in $(names); do
    rm -rf "${R:?}/$n" "$R/$n".*.log && mkdir -p $R/$n
    # STOP_AT=0: tune preps, starts the training in the background and returns.
    (STOP_AT=0 run_for $n tune > $R/$n.tune.log 2>&1) &
    pids="$pids $!"
    echo "started $n: $(env_of $n), task +[$SWEEP_TASK_MORE $(field $n 2)]," \
      "train +[$SWEEP_MORE $(field $n 3)]"
  done
  local bad=0
  for p in $pids; do wait $p || bad=1; done
  for n in $(names); do grep -E '"tasks"' $R/$n.tune.log | cut -c1-200; done
  if [ $bad = 1 ]; then
    for n in $(names); do echo "== $n"; tail -8 $R/$n.tune.log | cut -c1-300; done
    echo "a variant failed to start"; exit 1; fi
  echo "all started after $(( $(date +%s) - T0 )) s"
  wait_loop
}
summary16k() {  # one line per evaluated variant: its 16K accuracy by family
  # var_track_after: var_track accuracy split by whether the distractor
  # chain's value comes after the queried one's ("True"), the layout of most
  # misses (var_track_layout.py; computed once, cached beside eval.json).
  # bind1_late: [right, of] on 1-hop chains whose other value is the later
  # one (var_track_attention.py in device_run.sh finish; null without it).
  for n in $(names); do
    [ -f $R/$n/eval/eval.json ] || continue
    $PY - $n $R/$n/eval/eval.json <<'PYEOF'
import json, os, sys
e = json.load(open(sys.argv[2]))
cache = os.path.join(os.path.dirname(sys.argv[2]), "var_track_layout.json")
try:
    if not os.path.exists(cache):
        sys.path.insert(0, "training")
        import var_track_layout
        with open(cache + ".tmp", "w") as f:
            json.dump(var_track_layout.eval_summary(e["tasks"]["tasks"]), f)
        os.replace(cache + ".tmp", cache)
    after = json.load(open(cache))
except Exception as ex:  # the summary line matters more than this column
    print(f"var_track_layout failed for {sys.argv[1]}: {ex!r}", file=sys.stderr)
    after = None
bind1 = os.path.join(os.path.dirname(sys.argv[2]), "bind1.json")  # device_run.sh finish
try:
    b = next(iter(json.load(open(bind1))["by_length"].values()))
    bind = [b["right"], b["n"]]
except Exception:
    bind = None
by = e["tasks"]["by"]
fams = ("niah_single", "niah_multi", "kv_table", "var_track", "section_copy")
k16 = [by.get(f"family:{f}/length:16384", [0, 0])[0] for f in fams]
print(json.dumps({"variant": sys.argv[1], "correct": by["all"][0], "of": by["all"][1],
                  "16K": k16, "16K_sum": sum(k16), "var_track_after": after,
                  "bind1_late": bind,
                  "by_family": {f: by.get(f"family:{f}", [0, 0])[0] for f in fams},
                  "ppl": {n: round(p["ppl"], 2) for n, p in e["perplexity"].items()},
                  "sparse": {k: round(e.get("sparse_fidelity", {}).get(k, -1.0), 4)
                             for k in ("agreement_first_prompt", "agreement_mean", "mean_kl")}}))
PYEOF
  done
}
do_take() {  # $OUT/NAME/: the xz'd shards (4), and small.tar with the rest
  local n=$1 d=$OUT/$1
  [ -d $R/$n/run/final ] || { echo "take: no $R/$n/run/final"; exit 1; }
  rm -rf $d /tmp/take-$n && mkdir -p $d /tmp/take-$n
  # .part, then renamed: a call that ends mid-take (run 12's last call:
  # timeout_s only 25 s past STOP_AT) returns no shard that looks whole.
  for f in $R/$n/run/final/*.safetensors; do
    b=$(basename $f)
    xz -T0 -6 -c $f > $d/$b.xz.part && mv $d/$b.xz.part $d/$b.xz
  done
  cp $R/$n/run/final/config.json $R/$n/run/final/model.safetensors.index.json /tmp/take-$n/
  for f in tokenizer.model docs.tsv heldout.txt.xz unigram_counts.npy; do
    [ -f $TUNE_INIT/$f ] && cp $TUNE_INIT/$f /tmp/take-$n/; done
  tar cf $d/small.tar -C /tmp/take-$n .
  echo "take: $n -> \$OUT/$n ($(du -sh $d | cut -f1); tar xf small.tar beside the shards)"
}
collect() {  # what is finished, to $OUT: evaluations, and the best evaluated one's weights
  [ -n "${OUT:-}" ] || return 0
  mkdir -p $OUT
  # The device tool returns at most 8 files of at most 16 MiB: every
  # evaluated variant's pack.tar goes into one packs.tar.xz (NAME.tar each),
  # and do_take adds the 4 shards and small.tar, 7 files in all.
  rm -rf /tmp/packs && mkdir -p /tmp/packs
  for n in $(names); do
    if [ "$(state_of $n)" = evaluated ]; then
      cp $R/$n/out/pack.tar /tmp/packs/$n.tar
    elif [ "$(state_of $n)" = "eval failed" ]; then
      echo "== $n: evaluation failed"; tail -8 $R/$n.finish.log | cut -c1-300
    elif [ "$(state_of $n)" = "training died" ]; then
      echo "== $n: training died"; grep -v Warn $R/$n/train.log | tail -8 | cut -c1-300; fi
  done
  if ls /tmp/packs/*.tar >/dev/null 2>&1; then
    tar cf - -C /tmp/packs . | xz -T0 -6 > $OUT/packs.tar.xz; fi
  summary16k > $OUT/summary16k.jsonl
  cat $OUT/summary16k.jsonl
  # Not all in yet: the best evaluated one's weights come back anyway (run 13
  # lost a 100-of-100 round: its call ended before the last evaluation, and
  # the machine went back before the next call); a wait call takes again.
  local all=1
  settled || { all=0; echo "not all evaluated yet: call wait again (taking the best so far)"; }
  local best=${TAKE:-$(python3 -c "
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith('{')]
ok = [r for r in rows if 0 <= r['sparse']['mean_kl'] <= float(sys.argv[2])]
if rows and not ok:
    print(f'no variant has sparse-fidelity KL <= {sys.argv[2]}: taking the best of all',
          file=sys.stderr)
print(max(ok or rows, key=lambda r: (r['16K_sum'], r['correct']))['variant'] if rows else '')
" $OUT/summary16k.jsonl $SPARSE_MAX_KL)}
  if [ -n "$best" ]; then do_take $best; echo "$best" > $R/BEST; fi
  [ $all = 0 ] || echo "sweep complete after $(( $(date +%s) - T0 )) s of this call"
}
case "$1" in
start) do_start ;;
wait) need_sweep; wait_loop ;;
finish1)  # one variant's evaluation (wait_loop starts it with setsid)
  set +e; run_for "$2" finish; echo $? > $R/$2/finish.rc.tmp; mv $R/$2/finish.rc.tmp $R/$2/finish.rc ;;
take) need_sweep; do_take "$2" ;;
stage) do_stage ;;
report) need_sweep; report; summary16k ;;
*) echo "usage: $0 stage|start|wait|take NAME|report" >&2; exit 2 ;;
esac
