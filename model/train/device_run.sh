#!/bin/bash
# Reference model v2 (issue 17) on the GPU machine, in calls of at most 10
# minutes each. Runs from the repository root; see NOTES.md ("v2") for the
# order of the calls and what to carry. State lives in $W (outside the tree,
# kept while the machine stays warm); what ships goes to $OUT (files <= 16 MiB).
#   prep:   tokenize the corpus, generate the training tasks and the held-out
#           evaluation tasks, check llama.py against transformers, run a
#           30-second smoke test of train/eval on the real data, then start the
#           real training in the background (setsid; checkpoints in $W/run) and
#           watch it until ~STOP_AT seconds.
#   watch:  watch the training until ~STOP_AT seconds (training goes on between
#           calls while the machine is warm).
#   resume: the training process is gone (crash, out of memory) but $W/run has a
#           checkpoint: restart it with --resume, then watch.
#   finish: wait for DONE, evaluate (perplexity 1K..32K, sinks, task accuracy by
#           family x length x depth), make the reference golden file, re-check
#           the tiny goldens, and copy the weights and a tar of the results to $OUT.
set -e
export PYTHONUNBUFFERED=1
T0=$(date +%s)
STOP_AT=${STOP_AT:-540}
C=model/train/work/carry
W=/root/ctxrun2
# Training: 20 minutes of GPU time; 4K..32K phases at 131K tokens per step,
# the last 35% of the time at >= 16K.
TRAIN_ARGS=${TRAIN_ARGS:-"--minutes 20 --phases 4096:32,8192:16,16384:8,32768:4 \
  --phase-frac 0.35,0.3,0.2,0.15 --task-frac 0.5 --answer-weight 1.0"}
TASK_ARGS=${TASK_ARGS:-"--task-lengths 4096,8192,16384,32768 --tasks-per-length 2048 --task-seed 1"}
EVAL_DOCS=tests/data/demo/vim_help.txt,tests/data/demo/r_admin.txt,tests/data/demo/linux_firmware_guide.txt,tests/data/demo/document.txt
mkdir -p $W
watch() {
  while [ $(( $(date +%s) - T0 )) -lt $STOP_AT ]; do
    if [ -f $W/run/DONE ]; then break; fi
    if ! kill -0 $(cat $W/train.pid) 2>/dev/null; then
      echo "training process is gone"; tail -30 $W/train.log; exit 1; fi
    sleep 15
  done
  grep -v Warning $W/train.log | tail -6
}
start_training() {
  setsid nohup python3 model/train/train.py train --data $W/data --run $W/run --resume \
    $TRAIN_ARGS > $W/train.log 2>&1 < /dev/null &
  echo $! > $W/train.pid
  echo "training started: train.py train --data $W/data --run $W/run --resume $TRAIN_ARGS"
}
case "$1" in
prep)
  nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
  python3 model/train/train.py prep --corpus $C --tok $C/tokenizer.model --data $W/data \
    $TASK_ARGS --eval-docs $EVAL_DOCS --eval-per-cell 2
  python3 model/train/train.py bench 2>&1 | grep '^{'
  rm -rf $W/smoke
  python3 model/train/train.py train --data $W/data --run $W/smoke --minutes 0.5 --warmup 5 \
    --val-every 20 --ckpt-every 50 $(echo "$TRAIN_ARGS" | sed 's/--minutes [0-9.]*//') \
    2>&1 | grep -v Warn | tail -3
  cp $C/tokenizer.model $W/smoke/final/
  python3 model/train/train.py hfcheck --model $W/smoke/final 2>&1 | grep -v Warn
  python3 model/train/train.py eval --data $W/data --model $W/smoke/final --run $W/smoke \
    --out $W/smoke/eval --eval-tokens 40000 --task-limit 10 2>&1 | grep -v Warn | tail -4
  echo "smoke test passed after $(( $(date +%s) - T0 )) s"
  rm -rf $W/run
  start_training
  watch
  ;;
watch)
  watch
  ;;
resume)
  if kill -0 $(cat $W/train.pid) 2>/dev/null; then echo "still running"; else start_training; fi
  watch
  ;;
finish)
  while [ ! -f $W/run/DONE ]; do
    kill -0 $(cat $W/train.pid) 2>/dev/null || { tail -30 $W/train.log; exit 1; }
    sleep 5
  done
  grep -v Warning $W/train.log | tail -4
  F=$W/run/final
  cp $C/tokenizer.model $F/
  python3 model/train/train.py hfcheck --model $F 2>&1 | grep -v Warn
  python3 model/train/train.py eval --data $W/data --model $F --run $W/run --out $W/eval \
    $([ -f $C/unigram_counts_train.npy ] && echo --unigram-counts $C/unigram_counts_train.npy) \
    --names $C/docs.tsv --exclude '^erlang-doc/' \
    2>&1 | grep -v Warn
  mkdir -p $W/golden-ref
  python3 model/train/make_golden.py ref --model $F --input-text tests/data/demo/document.txt \
    --out $W/golden-ref 2>&1 | grep -v Warn | tee $W/golden-ref/report.txt
  python3 model/train/make_golden.py tiny --out $W/tiny 2>&1 | grep '^{' | cut -c1-200
  for n in llama3 qwen2 mistral smollm; do
    cmp $W/tiny/$n/golden.safetensors tests/data/golden/$n/golden.safetensors \
      && cmp $W/tiny/$n/model.safetensors tests/data/golden/$n/model.safetensors \
      && echo "tiny $n: identical on re-run"
  done
  mkdir -p $W/pack
  cp $F/config.json $F/model.safetensors.index.json $W/eval/* $W/run/summary.json \
    $W/run/log.jsonl $W/train.log $W/golden-ref/* $W/pack/ 2>/dev/null || true
  cp $F/*.safetensors $OUT/
  (cd $W/pack && tar cf $OUT/pack.tar .)
  ls -la $OUT $F
  ;;
*)
  echo "usage: $0 prep|watch|resume|finish" >&2
  exit 2
  ;;
esac
