#!/bin/sh
# Trains the reference-model tokenizer (sentencepiece BPE, vocab 8192, byte fallback).
# Usage: sh training/train_tokenizer.sh [WORK]   (after make_corpus.py)
set -e
W=${1:-training/work}
mkdir -p "$W/tok"
spm_train --input="$W/corpus/train.txt" --model_prefix="$W/tok/tokenizer" \
  --vocab_size=8192 --model_type=bpe --byte_fallback=true \
  --character_coverage=0.9995 --normalization_rule_name=identity \
  --remove_extra_whitespaces=false --allow_whitespace_only_pieces=true \
  --split_digits=true --max_sentence_length=8192 \
  --unk_id=0 --bos_id=1 --eos_id=2 --pad_id=-1 \
  --unk_piece='<unk>' --bos_piece='<s>' --eos_piece='</s>' \
  --input_sentence_size=1000000 --shuffle_input_sentence=true --seed_sentencepiece_size=1000000 \
  --num_threads=2
