#!/bin/bash
# Runs on the GPU machine from the repository root (see NOTES.md for the calls).
#   start:  tokenize, smoke-test every stage on a 20-second run, then start the real
#           training in the background (setsid) and watch it until ~STOP_AT seconds.
#   watch:  watch the training log until ~STOP_AT seconds.
#   finish: wait for the training to end, evaluate, make the reference golden file,
#           re-check the tiny goldens, and copy what ships to $OUT.
set -e
export PYTHONUNBUFFERED=1
T0=$(date +%s)
STOP_AT=${STOP_AT:-560}
C=model/train/work/carry
W=/root/ctxrun
TRAIN_ARGS=${TRAIN_ARGS:-"--minutes 12 --seq 8192 --batch 16 --long-seq 16384 --long-frac 0.1"}
mkdir -p $W
watch() {
  while [ $(( $(date +%s) - T0 )) -lt $STOP_AT ]; do
    if [ -f $W/run/DONE ]; then break; fi
    if ! kill -0 $(cat $W/train.pid) 2>/dev/null; then
      echo "training process is gone"; tail -30 $W/train.log; exit 1; fi
    sleep 15
  done
  grep -v Warning $W/train.log | tail -8
}
case "$1" in
start)
  nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
  python3 model/train/train.py prep --corpus $C --tok $C/tokenizer.model --data $W/data
  python3 model/train/train.py train --data $W/data --run $W/smoke --minutes 0.3 \
    --calib-steps 10 --warmup 5 --val-every 20 --ckpt-every 50 --seq 8192 --batch 16 \
    --long-seq 16384 --long-frac 0.2 2>&1 | grep -v Warn | tail -4
  cp $C/tokenizer.model $W/smoke/final/
  python3 model/train/train.py eval --data $W/data --model $W/smoke/final --run $W/smoke \
    --out $W/smoke/eval --eval-tokens 40000 2>&1 | grep -v Warn | tail -8
  python3 model/train/make_golden.py ref --model $W/smoke/final --heldout $C/heldout.txt \
    --out $W/smoke/golden 2>&1 | grep -v Warn | tail -30
  echo "smoke test passed after $(( $(date +%s) - T0 )) s"
  rm -rf $W/run
  setsid nohup python3 model/train/train.py train --data $W/data --run $W/run $TRAIN_ARGS \
    > $W/train.log 2>&1 < /dev/null &
  echo $! > $W/train.pid
  echo "training started: train.py train --data $W/data --run $W/run $TRAIN_ARGS"
  watch
  ;;
watch)
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
  rm -f $F/generation_config.json
  python3 -c "from transformers import LlamaForCausalLM; m = LlamaForCausalLM.from_pretrained('$F'); print('loaded', type(m).__name__, m.num_parameters(), 'params', m.dtype)"
  python3 model/train/train.py eval --data $W/data --model $F --run $W/run --out $W/eval 2>&1 \
    | grep -v Warn
  mkdir -p $W/golden-ref
  python3 model/train/make_golden.py ref --model $F --heldout $C/heldout.txt \
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
reeval)
  # Re-evaluate the shipped model (models/ctxcache-ref travels with the tree) with
  # held-out docs that overlap the training text excluded, and remake the golden file.
  python3 model/train/train.py prep --corpus $C --tok $C/tokenizer.model --data $W/data \
    --splits heldout
  M=models/ctxcache-ref
  python3 -c "from transformers import LlamaForCausalLM; m = LlamaForCausalLM.from_pretrained('$M'); print('loaded', type(m).__name__, m.num_parameters(), 'params', m.dtype)"
  python3 model/train/train.py eval --data $W/data --model $M --run $C --out $W/eval \
    --unigram-counts $C/unigram_counts_train.npy --names $C/docs.tsv \
    --exclude '^erlang-doc/' 2>&1 | grep -v Warn
  mkdir -p $W/golden-ref
  python3 model/train/make_golden.py ref --model $M --input-text tests/data/demo/document.txt \
    --out $W/golden-ref 2>&1 | grep -v Warn | tee $W/golden-ref/report.txt
  cp $W/eval/* $W/golden-ref/* $OUT/
  ls -la $OUT
  ;;
esac
