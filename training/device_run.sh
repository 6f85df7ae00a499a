#!/bin/bash
# Reference model v2 (issue 17) on the GPU machine, in calls of at most 10
# minutes each. Runs from the repository root; see training/README.md for the
# order of the calls and what to carry. State lives in $W (outside the tree,
# kept while the machine stays warm); what ships goes to $OUT (files <= 16 MiB).
#   prep:   tokenize the corpus, generate the training tasks and the held-out
#           evaluation tasks, run a 30-second smoke test of train -> hfcheck ->
#           eval on the real data, then start the real training in the
#           background (setsid; checkpoints in $W/run) and watch it until
#           ~STOP_AT seconds. BENCH=1 adds the throughput bench (~1 min).
#   watch:  watch the training until DONE or ~STOP_AT seconds (training goes on
#           between calls while the machine is warm).
#   tune:   continued training (v2 runs 3-10): unpack the weights in $TUNE_INIT
#           (any folder of a saved model, shards raw or xz'd; default the
#           shipped models/ctxcache-ref, see TUNE_INIT below),
#           prep the data with TUNE_TASK_ARGS (new task seed), no smoke test
#           (the recipe ran in run 2; --init-from is covered by the CPU ctest
#           train_cpu_smoke), train from those weights with TUNE_ARGS in the
#           background, watch. EVAL_ALSO=DIR also runs evalsaved on the saved
#           model in DIR in the background, sharing the GPU with the training;
#           watch copies its results to $OUT/evalsaved once done. Then watch /
#           finish as after prep.
#   progress: one JSON line, the training's last logged step (device_sweep.sh).
#   unpack: unpack $TUNE_INIT and the carried held-out text only (device_sweep.sh
#           does it once before its variants' tunes run at the same time).
#   resume: the training process is gone (crash, out of memory) but $W/run has a
#           checkpoint: restart it with --resume, then watch.
#   finish: wait for DONE, evaluate (perplexity 1K..32K, sinks, task accuracy by
#           family x length x depth), make the reference golden file, re-check
#           the tiny goldens, and copy the weights and a tar of the results to $OUT.
#   dry:    TINY=1 only: prep, watch and finish in one go (the whole sequence).
#   evalsaved: evaluate a saved model from a carried folder $S, without the
#           training corpus (see do_evalsaved); TINY=1 evaluates the dry run's.
#
# TINY=1: the same sequence on the CPU with a 2-layer model, 512/1024-token
# tasks and a 3 MB slice of the carried corpus, in $W=training/work/tiny
# (about 2-4 minutes on one core): checks the script and train.py end to end
# before device time is spent. Steps that need transformers (hfcheck,
# make_golden.py) or a GPU are skipped with a note when those are missing.
set -e
export PYTHONUNBUFFERED=1
# tune with EVAL_ALSO runs two processes on the GPU: growable segments fragment less.
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
T0=$(date +%s)
C=${C:-training/work/carry}  # the carried corpus (training/README.md)
EVAL_DOCS=tests/data/demo/vim_help.txt,tests/data/demo/r_admin.txt,tests/data/demo/linux_firmware_guide.txt,tests/data/demo/document.txt
if [ "${TINY:-0}" = 1 ]; then
  PY=${PY:-/usr/bin/python3}
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
  W=${W:-training/work/tiny}
  OUT=${OUT:-$W/out}
  STOP_AT=${STOP_AT:-600}
  DEV="--device cpu"
  MODEL="--hidden 64 --ffn 128 --layers 2 --heads 4 --kv-heads 2"
  TRAIN_ARGS=${TRAIN_ARGS:-"--steps 24 --phases 512:4,1024:2 --phase-frac 0.5,0.5 \
    --task-frac 0.6 --answer-weight 20 --warmup 4 --val-seq 512 --val-every 8 --log-every 4 \
    --ckpt-every 10"}
  SMOKE_ARGS="--steps 6 --warmup 2 --val-every 4 --log-every 2 --ckpt-every 4"
  TASK_ARGS=${TASK_ARGS:-"--task-lengths 512,1024 --tasks-per-length 24,12 --task-seed 1 --procs 2"}
  EVAL_TASK_ARGS="--eval-lengths 1024 --eval-depths 0.1,0.9 --eval-per-cell 1"
  BIND_LENGTH=1024
  EVAL_ARGS="--ppl-lengths 256,512 --eval-tokens 2048 --sink-len 256 --sparse-new 4"
  SMOKE_EVAL="--ppl-lengths 256 --eval-tokens 1024 --sink-len 128 --task-limit 2"
  TUNE_INIT=${TUNE_INIT:-$W/saved}
  TUNE_ARGS=${TUNE_ARGS:-"--steps 12 --phases 512:4,1024:2 --phase-frac 0.5,0.5 \
    --task-frac 0.5 --answer-weight 20 --lr 3e-4 --warmup 4 --val-seq 512 --val-every 6 \
    --log-every 4 --ckpt-every 6"}
  TUNE_TASK_ARGS=${TUNE_TASK_ARGS:-"--task-lengths 512,1024 --tasks-per-length 24,12 --task-seed 2 \
    --extra-questions 4 --procs 2"}
else
  PY=${PY:-python3}
  W=${W:-/root/ctxrun2}
  STOP_AT=${STOP_AT:-570}
  DEV=""
  MODEL=""
  # 14 minutes of H100 time (~400M tokens at 286K-595K tok/s): 4K -> 8K -> 16K
  # -> 32K, the last 40% of the time at >= 16K. 60% of the rows are tasks;
  # an answer token weighs 20 ordinary ones (train.py lm_loss).
  TRAIN_ARGS=${TRAIN_ARGS:-"--minutes 14 --phases 4096:32,8192:16,16384:8,32768:4 \
    --phase-frac 0.35,0.25,0.25,0.15 --task-frac 0.6 --answer-weight 20"}
  SMOKE_ARGS="--minutes 0.5 --warmup 5 --val-every 20 --ckpt-every 50"
  # Enough tasks that each is seen ~1-2 times at --task-frac 0.6 (~185M tokens).
  TASK_ARGS=${TASK_ARGS:-"--task-lengths 4096,8192,16384,32768 \
    --tasks-per-length 12288,6144,3072,1024 --task-seed 1"}
  # tune = v2 run 7's recipe: run 6's weights (xz'd in training/work/run6c)
  # trained 9 more minutes with --extra-questions 4 (an 18-minute attempt was
  # lost with its machine; docs/history.md "v2 runs 5 (evaluated), 6 and 7"): each
  # training task row asks up to 4 of its other needles after its answer, so
  # a 16K context trains ~4x the retrievals for ~1% more tokens (runs 3-6 gave
  # each long row one answer of ~10 tokens). Result: 321/400, four families
  # up and var_track down 60 -> 45 of 80. Run 6 (13 minutes from run 5, the
  # same phases, task-frac and lr as here, task seed 7, niah_multi:3,
  # kv_table:2,var_track:2,section_copy:2): 320/400, 16K 83/100. Run 5 (v2 grown to 10
  # layers): "--layers 10 --minutes 19 --phase-frac 0.15,0.25,0.4,0.2
  # --task-frac 0.7 --lr 6e-4 --warmup 100" from models/ctxcache-ref, task
  # seed 6. Run 4 (13 minutes at 8 layers, --phase-frac 0.1,0.2,0.45,0.25
  # --task-frac 0.8 --lr 5e-4, task seed 3) gained 3 tasks of 200; run 3's
  # recipe: "--minutes 10 --phase-frac 0.15,0.25,0.35,0.25 --task-frac 0.7
  # --lr 6e-4" with --tasks-per-length 4096,4096,3072,1536 --task-seed 2.
  # Run 10 (v2.1) used this recipe through device_sweep.sh with
  # --layers 8 --minutes 3.3, lr 5e-4, --extra-questions 8
  # --no-distractor-questions, var_track weight 4 and make_corpus.py's extra
  # text (docs/history.md "v2 run 10"). The defaults start from the shipped model at
  # its depth: weights kept in the ignored work/ do not survive a session.
  TUNE_INIT=${TUNE_INIT:-models/ctxcache-ref}
  TUNE_ARGS=${TUNE_ARGS:-"--layers 8 --minutes 9 --phases 4096:32,8192:16,16384:8,32768:4 \
    --phase-frac 0.1,0.2,0.5,0.2 --task-frac 0.5 --answer-weight 20 --lr 3e-4 \
    --warmup 50"}
  TUNE_TASK_ARGS=${TUNE_TASK_ARGS:-"--task-lengths 4096,8192,16384,32768 \
    --tasks-per-length 4096,6144,8192,2048 --task-seed 8 --extra-questions 4 \
    --family-weights niah_single:1,niah_multi:2,kv_table:2,var_track:2,section_copy:3"}
  # 4 lengths x 5 depths x 5 families x 4 = 400 held-out tasks (20 per family
  # and length; runs 2-3 had 2 per cell, a superset of which these are).
  EVAL_TASK_ARGS=${EVAL_TASK_ARGS:-"--eval-per-cell 4"}
  BIND_LENGTH=4096
  EVAL_ARGS=""
  SMOKE_EVAL="--eval-tokens 40000 --task-limit 10"
fi
# TUNE_MORE / TUNE_TASK_MORE are appended (a repeated train.py flag: the last
# one wins), so device_sweep.sh varies one recipe without restating it.
TUNE_ARGS="$TUNE_ARGS ${TUNE_MORE:-}"
TUNE_TASK_ARGS="$TUNE_TASK_ARGS ${TUNE_TASK_MORE:-}"
mkdir -p $W
# The carry may hold heldout.txt.xz instead of heldout.txt (the tracked tree
# plus the carry must stay under the 64 MiB a device call takes).
if [ ! -f $C/heldout.txt ] && [ -f $C/heldout.txt.xz ]; then xz -dk $C/heldout.txt.xz; fi
have_hf() { $PY -c "import transformers" 2>/dev/null; }
progress() {  # the last logged step and the last held-out loss, compactly
  $PY - $W/run/log.jsonl <<'PYEOF' || true
import json, sys
recs = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
if recs:
    r = recs[-1]
    v = [x for x in recs if "val_loss" in x]
    f = lambda x: None if x is None else round(x, 3)
    print(json.dumps({"step": r["step"], "seq": r["seq"], "elapsed_s": round(r["elapsed_s"]),
                      "lm_loss": f(r.get("lm_loss")), "answer_loss": f(r.get("answer_loss")),
                      "grad_norm": f(r["grad_norm"]), "lr": r["lr"],
                      "val_loss": f(v[-1]["val_loss"]) if v else None,
                      "val_step": v[-1]["step"] if v else None}))
PYEOF
}
evalsaved_out() {  # tune's background evalsaved (EVAL_ALSO): its state, its files to $OUT
  [ -f $W/evalsaved.pid ] || return 0
  if [ "${1:-}" = wait ]; then
    while kill -0 "$(cat $W/evalsaved.pid)" 2>/dev/null; do sleep 5; done; fi
  if [ -f $W/evalsaved/card.md ]; then
    if [ -n "${OUT:-}" ] && [ ! -f $OUT/evalsaved/card.md ]; then
      mkdir -p $OUT && cp -r $W/evalsaved $OUT/ && echo "evalsaved: done, in \$OUT/evalsaved"; fi
  elif kill -0 "$(cat $W/evalsaved.pid)" 2>/dev/null; then
    echo "evalsaved: running"; tail -2 $W/evalsaved.log | cut -c1-300
  else echo "evalsaved: failed"; tail -5 $W/evalsaved.log | cut -c1-300; fi
}
watch() {
  while [ $(( $(date +%s) - T0 )) -lt $STOP_AT ]; do
    if [ -f $W/run/DONE ]; then break; fi
    if ! kill -0 "$(cat $W/train.pid)" 2>/dev/null; then
      echo "training process is gone"; tail -30 $W/train.log; exit 1; fi
    sleep 15
  done
  grep -v Warning $W/train.log | tail -3 | cut -c1-400
  progress
  evalsaved_out
  if [ -f $W/run/DONE ]; then
    # The machine goes back 30 s after a call ends: if the next call comes
    # late, everything in $W is lost (run 2 lost its weights this way). Save
    # the final checkpoint now, in pieces under the 16 MiB limit of $OUT, and
    # finish in this call when there is time for it (~3 minutes).
    if [ -n "${OUT:-}" ] && [ -d $W/run/final ]; then
      mkdir -p $OUT
      tar -C $W/run -cf - final log.jsonl | xz -T0 | split -b 15M - $OUT/final.tar.xz.part-
      echo "final checkpoint saved to \$OUT/final.tar.xz.part-* (cat | xz -d | tar x)"
    fi
    if [ $(( $(date +%s) - T0 )) -lt ${FINISH_BEFORE:-380} ]; then
      do_finish
      [ "${DRY:-0}" = 1 ] && echo "dry run passed after $(( $(date +%s) - T0 )) s"
      exit 0
    fi
    echo "training DONE: call finish"; else
    echo "training still running after $(( $(date +%s) - T0 )) s: call watch again"; fi
}
start_training() {
  setsid nohup $PY training/train.py train --data $W/data --run $W/run --resume \
    $DEV $MODEL $TRAIN_ARGS > $W/train.log 2>&1 < /dev/null &
  echo $! > $W/train.pid
  echo "training started: train.py train --data $W/data --run $W/run --resume" \
    "$DEV $MODEL $TRAIN_ARGS"
}
tiny_carry() {  # TINY: a 3 MB slice of the carried corpus, the real held-out split
  local t=$W/carry
  mkdir -p $t
  xz -dc $C/train.txt.xz | head -c 3000000 > $t/train.txt || true
  cp $C/heldout.txt $C/docs.tsv $C/tokenizer.model $t/
  C=$t
}
do_prep() {
  if [ "${TINY:-0}" = 1 ]; then tiny_carry; else
    nvidia-smi --query-gpu=name,memory.used --format=csv,noheader; fi
  $PY training/train.py prep --corpus $C --tok $C/tokenizer.model --data $W/data \
    $TASK_ARGS --eval-docs $EVAL_DOCS $EVAL_TASK_ARGS
  if [ "${BENCH:-0}" = 1 ]; then $PY training/train.py bench 2>&1 | grep '^{'; fi
  rm -rf $W/smoke
  # The smoke run: the real phases, mix and loss for a few steps (all phases
  # at --minutes 0.5), so a crash at 32K shows here and not in the real run.
  local keep
  keep=$(echo "$TRAIN_ARGS" |
    sed -E 's/--(minutes|steps|warmup|val-every|log-every|ckpt-every) [0-9.]+//g')
  $PY training/train.py train --data $W/data --run $W/smoke $DEV $MODEL $keep $SMOKE_ARGS 2>&1 | grep -v Warn | tail -2 | cut -c1-300
  cp $C/tokenizer.model $W/smoke/final/
  if have_hf; then
    $PY training/train.py hfcheck --model $W/smoke/final $DEV 2>&1 | grep -v Warn
  else echo "hfcheck skipped: no transformers here"; fi
  $PY training/train.py eval --data $W/data --model $W/smoke/final --run $W/smoke $DEV \
    --out $W/smoke/eval $SMOKE_EVAL 2>&1 | grep -v Warn | tail -2 | cut -c1-300
  test -f $W/smoke/eval/eval.json
  echo "smoke test passed after $(( $(date +%s) - T0 )) s"
  rm -rf $W/run
  start_training
  watch
}
unxz_dir() {  # a saved model's xz'd shards (scripts/unpack-models.sh) and heldout.txt.xz
  bash scripts/unpack-models.sh . "$1"
  if [ -f $1/heldout.txt.xz ] && [ ! -f $1/heldout.txt ]; then
    xz -dc $1/heldout.txt.xz > $1/heldout.txt.tmp && mv $1/heldout.txt.tmp $1/heldout.txt; fi
}
do_tune() {
  if [ "${TINY:-0}" = 1 ]; then tiny_carry; else
    nvidia-smi --query-gpu=name,memory.used --format=csv,noheader; fi
  unxz_dir $TUNE_INIT
  $PY training/train.py prep --corpus $C --tok $C/tokenizer.model --data $W/data \
    $TUNE_TASK_ARGS --eval-docs $EVAL_DOCS $EVAL_TASK_ARGS
  rm -rf $W/run $W/evalsaved $W/evalsaved.log $W/evalsaved.pid
  TRAIN_ARGS="$TUNE_ARGS --init-from $TUNE_INIT"
  start_training
  if [ -n "${EVAL_ALSO:-}" ]; then
    (S=$EVAL_ALSO; OUT=$W/evalsaved; do_evalsaved) > $W/evalsaved.log 2>&1 < /dev/null &
    echo $! > $W/evalsaved.pid
    echo "evalsaved of $EVAL_ALSO started in the background (log $W/evalsaved.log)"
  fi
  watch
}
run_eval() {  # train.py eval with the flags every evaluation shares, then $@
  $PY training/train.py eval $DEV --exclude '^erlang-doc/' $EVAL_ARGS "$@" 2>&1 | grep -v Warn
}
do_finish() {
  while [ ! -f $W/run/DONE ]; do
    kill -0 "$(cat $W/train.pid)" 2>/dev/null || { tail -30 $W/train.log; exit 1; }
    sleep 5
  done
  grep -v Warning $W/train.log | tail -2 | cut -c1-600
  F=$W/run/final
  cp $C/tokenizer.model $F/
  if have_hf; then
    $PY training/train.py hfcheck --model $F $DEV 2>&1 | grep -v Warn
  else echo "hfcheck skipped: no transformers here"; fi
  unigram=()
  [ -f $C/unigram_counts_train.npy ] && unigram=(--unigram-counts "$C/unigram_counts_train.npy")
  run_eval --data $W/data --model $F --run $W/run --out $W/eval --names $C/docs.tsv \
    "${unigram[@]}"
  # Chain binding without the recency cue (docs/history.md, run 12): 1-hop chains with
  # the other chain's value nearer the question; v2.2 answers 6 of 20 at 4K.
  if ! $PY training/var_track_attention.py --model $F --lengths $BIND_LENGTH --per-cell 4 \
      --var-links 2 --var-distractor-late 1.0 --out $W/eval/bind1.json > $W/bind1.log 2>&1; then
    echo "var_track_attention failed: no bind1.json"; fi
  grep -v Warn $W/bind1.log | tail -3 | cut -c1-200
  rm -rf $W/golden-ref $W/pack
  mkdir -p $W/golden-ref $W/pack $OUT
  if have_hf; then
    $PY training/make_golden.py ref --model $F --input-text tests/data/demo/document.txt \
      --out $W/golden-ref 2>&1 | grep -v Warn | tee $W/golden-ref/report.txt
    $PY training/make_golden.py tiny --out $W/tiny 2>&1 | grep '^{' | cut -c1-200
    for n in llama3 qwen2 mistral smollm; do
      cmp $W/tiny/$n/golden.safetensors tests/data/golden/$n/golden.safetensors \
        && cmp $W/tiny/$n/model.safetensors tests/data/golden/$n/model.safetensors \
        && echo "tiny $n: identical on re-run"
    done
  else echo "make_golden.py skipped: no transformers here"; fi
  cp $F/config.json $F/model.safetensors.index.json $W/eval/* $W/run/summary.json \
    $W/run/log.jsonl $W/train.log $W/pack/
  cp $W/golden-ref/* $W/pack/ 2>/dev/null || true
  # At most 64 MiB comes back from a call: run 5's final.tar.xz.part-* (37 MB)
  # plus the raw shards (52 MB) left pack.tar (the evaluation) behind. The raw
  # weights go only when watch has not saved them as final.tar.xz.part-* (the
  # same tensors, xz'd).
  (cd $W/pack && tar cf - .) > $OUT/pack.tar
  evalsaved_out wait
  if ! ls $OUT/final.tar.xz.part-* >/dev/null 2>&1; then cp $F/*.safetensors $OUT/; fi
  ls -la $OUT $F
}
do_evalsaved() {
  # A saved model evaluated without the training corpus (the tree, the corpus
  # and a model's xz'd shards do not fit one 64 MiB carry). $S (default
  # training/work/saved, carried) holds config.json,
  # model.safetensors.index.json, the shards (*.safetensors or
  # *.safetensors.xz), heldout.txt(.xz), docs.tsv and unigram_counts.npy
  # (np.bincount of the training tokens, minlength 8192). Writes $OUT/eval
  # (train.py eval's files) and $OUT/card.md.
  S=${S:-training/work/saved}
  unxz_dir $S
  [ -f $S/tokenizer.model ] || cp models/ctxcache-ref/tokenizer.model $S/
  $PY training/train.py prep --corpus $S --splits heldout --tok $S/tokenizer.model \
    --data $W/evdata --eval-docs $EVAL_DOCS $EVAL_TASK_ARGS
  mkdir -p $OUT/eval
  run_eval --data $W/evdata --model $S --out $OUT/eval --names $S/docs.tsv \
    --unigram-counts $S/unigram_counts.npy
  $PY training/card_tables.py $OUT/eval/eval.json > $OUT/card.md
  echo "evalsaved done after $(( $(date +%s) - T0 )) s"
}
case "$1" in
evalsaved) do_evalsaved ;;
prep) do_prep ;;
tune) do_tune ;;
watch) watch ;;
progress) progress ;;
unpack) unxz_dir $TUNE_INIT ;;
resume)
  if kill -0 "$(cat $W/train.pid)" 2>/dev/null; then echo "still running"; else start_training; fi
  watch
  ;;
finish) do_finish ;;
dry)
  if [ "${TINY:-0}" != 1 ]; then echo "dry: TINY=1 only" >&2; exit 2; fi
  DRY=1  # watch finishes and exits once the training is DONE
  do_prep
  T0=$(date +%s)
  watch
  do_finish
  echo "dry run passed after $(( $(date +%s) - T0 )) s of watch+finish"
  ;;
*)
  echo "usage: $0 prep|tune|watch|progress|unpack|resume|finish|evalsaved   (TINY=1 $0 dry: CPU dry run)" >&2
  exit 2
  ;;
esac
