#!/usr/bin/env bash
# The reference-model training pipeline (training/train.py, issue #17) on
# CPU with a tiny config: prep (corpus tokenizing, training tasks, held-out
# evaluation tasks), two resumed training chunks, eval (perplexity, sinks,
# full-attention task accuracy). Checks that every stage runs and writes its
# outputs; the numbers of a model this small mean nothing. Training is bounded
# by steps, not minutes, so a loaded machine runs the same work, only slower.
# Exit 77 (ctest skip) without torch (Debian: python3-torch).
#   train_cpu_smoke_test.sh REPO_ROOT
set -euo pipefail
root="$1"
py=/usr/bin/python3
if ! "$py" -c "import torch, numpy, sentencepiece" 2>/dev/null; then
  echo "python3-torch, python3-numpy or python3-sentencepiece missing; skipped"
  exit 77
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
demo="$root/tests/data/demo"
mkdir -p "$work/corpus"
for f in vim_help r_admin linux_firmware_guide; do cat "$demo/$f.txt"; printf '\x1e\n'; done \
  > "$work/corpus/train.txt"
{ cat "$demo/document.txt"; printf '\x1e\n'; } > "$work/corpus/heldout.txt"
tok="$root/models/ctxcache-ref/tokenizer.model"
T="$py $root/training/train.py"
$T prep --corpus "$work/corpus" --tok "$tok" --data "$work/data" --procs 2 \
  --tasks-per-length 10 --task-lengths 1024,2048 --eval-docs "$demo/document.txt" \
  --eval-lengths 1024,2048 --eval-depths 0.1,0.9 --eval-per-cell 1
M="--hidden 64 --ffn 128 --layers 2 --heads 4 --kv-heads 2 --device cpu"
TRAIN="$T train $M --data $work/data --run $work/run --phases 1024:4,2048:2 \
  --phase-frac 0.5,0.5 --warmup 5 --val-seq 512 --log-every 2 --val-every 4 --ckpt-every 5 --resume"
# Two chunks: 4 steps, then --resume from that checkpoint up to 8 steps.
$TRAIN --steps 4 > "$work/chunk1.log"
test -f "$work/run/ckpt.pt" && test -f "$work/run/DONE"
rm "$work/run/DONE"
$TRAIN --steps 8 > "$work/chunk2.log"
test -f "$work/run/DONE"
grep -q '^{"resumed": {"step": 4,' "$work/chunk2.log"
$T eval --device cpu --data "$work/data" --model "$work/run/final" --run "$work/run" \
  --out "$work/eval" --ppl-lengths 256,512 --eval-tokens 2048 --sink-len 256 --tok "$tok" \
  --task-limit 4 --sparse-new 8
# The model card's tables from that eval.json (training/card_tables.py).
"$py" "$root/training/card_tables.py" "$work/eval/eval.json" > "$work/card.md"
grep -q '^| 256 | ' "$work/card.md"   # perplexity at the eval's lengths
grep -q '^| 1 | ' "$work/card.md"     # attention sinks of layer 1 (2 layers)
grep -q '^| all | ' "$work/card.md"   # task accuracy by length
# Continued training (--init-from, v2 run 3): a fresh run from the saved
# final weights starts at the trained model's loss, not at a random init's.
# With itself as the distillation teacher (--distill-from), its text KL is 0.
$T train $M --data "$work/data" --run "$work/tune" --steps 2 --phases 1024:4 --phase-frac 1 \
  --warmup 1 --lr 1e-9 --log-every 1 --val-seq 512 --val-every 1 --init-from "$work/run/final" \
  --distill-from "$work/run/final"
# Depth growth (--layers above the saved model's): the inserted layer starts
# as the identity, so the grown model also starts at the trained loss.
$T train $M --layers 3 --data "$work/data" --run "$work/grow" --steps 2 --phases 1024:4 \
  --phase-frac 1 --warmup 1 --lr 1e-9 --log-every 1 --val-seq 512 --val-every 1 \
  --init-from "$work/run/final"
$T train $M --data "$work/data" --run "$work/scratch" --steps 2 --phases 1024:4 --phase-frac 1 \
  --warmup 1 --lr 1e-9 --log-every 1 --val-seq 512 --val-every 1
"$py" - "$work" <<'PY'
import json, os, sys
w = sys.argv[1]
first = lambda r: json.loads(open(os.path.join(w, r, "log.jsonl")).readline())
tune, scratch, grow = first("tune"), first("scratch"), first("grow")
# The saved final weights' validation loss (summary.json).
trained = json.load(open(os.path.join(w, "run", "summary.json")))["final_val_loss"]
# lr 1e-9: the loaded weights (bf16) unchanged.
assert abs(tune["val_loss"] - trained) < 0.1, (tune, trained)
assert tune["val_loss"] < scratch["val_loss"], (tune, scratch)
assert abs(grow["val_loss"] - trained) < 0.1, (grow, trained)
assert 0 <= tune["distill_kl"] < 1e-3, tune
assert scratch["distill_kl"] is None, scratch
print("init-from: val loss", round(tune["val_loss"], 3), "= trained", round(trained, 3),
      "; from a random init", round(scratch["val_loss"], 3))
s = json.load(open(os.path.join(w, "run", "summary.json")))
e = json.load(open(os.path.join(w, "eval", "eval.json")))
log = [json.loads(l) for l in open(os.path.join(w, "run", "log.jsonl"))]
assert s["task_rows"] > 0 and s["steps"] == 8, s
# Phases switch on the fraction of --steps done, so both lengths are trained
# (1024 for the first chunk's first half, 2048 from then on).
assert [r["step"] for r in log] == [1, 2, 4, 6, 8], log
assert {r["seq"] for r in log} == {1024, 2048}, {r["seq"] for r in log}
assert e["perplexity"]["512"]["windows"] > 0, e["perplexity"]
assert e["tasks"]["by"]["all"][1] == 4, e["tasks"]["by"]
# A missed task's row says what the model answered (train.miss_detail).
for t in e["tasks"]["tasks"]:
    assert t["correct"] or {"answer", "got", "first_wrong", "got_in_context"} <= set(t), t
assert len(e["attention_sinks"]["doc_start"]["layers"]) == 2
assert os.path.exists(os.path.join(w, "eval", "loss_curve.png"))
# The sparse-fidelity proxy: eval-agreement.sh's document and 6 prompts.
sf = e["sparse_fidelity"]
assert (sf["prompts"], sf["new_tokens"], sf["rho"]) == (6, 8, 0.05), sf
assert sf["context_tokens"] > 9000 and len(sf["per_prompt"]) == 6, sf
assert 0 <= sf["agreement_min"] <= sf["agreement_mean"] <= 1 and sf["mean_kl"] >= 0, sf
print("train_cpu_smoke: steps", s["steps"], "task rows", s["task_rows"], "of", s["rows"])
PY
# The miss diagnosis (training/diag_tasks.py): accuracy on three task sets
# and, per miss, wrong binding vs copy drift. The 2-layer model misses nearly
# everything, so every row of a miss must carry its diagnosis.
"$py" "$root/training/diag_tasks.py" --model "$work/run/final" --device cpu \
  --train-docs "$work/corpus/train.txt" --heldout "$work/corpus/heldout.txt" \
  --lengths 1024 --per-cell 1 --limit 3 --out "$work/diag.json" > "$work/diag.log"
"$py" - "$work/diag.json" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))
assert sorted(k.split("|")[1] for k in d) == ["eval", "heldout_corpus", "train_docs"], list(d)
for k, v in d.items():
    assert v["by"]["all"][1] == 3 and len(v["rows"]) == 3, (k, v["by"])
    for r in v["rows"]:
        assert r["tf_logp"] <= 0 and 0 <= r["min_token_p"] <= 1, r
        if not r["correct"]:
            assert {"answer", "got", "first_wrong", "got_in_context"} <= set(r), r
    assert v["misses"] == sum(not r["correct"] for r in v["rows"]), v
print("diag_tasks: ok", {k.split("|")[1]: v["by"]["all"] for k, v in d.items()})
PY
# --teacher-forced decides from one forward what greedy decoding decides token
# by token: the same verdict, and for a miss the same first wrong position
# (greedy's tokens before it are the answer's, so the prefixes agree there).
"$py" "$root/training/diag_tasks.py" --model "$work/run/final" --device cpu --teacher-forced \
  --lengths 1024 --per-cell 1 --limit 3 --out "$work/diag-tf.json" > "$work/diag-tf.log"
"$py" - "$work/diag.json" "$work/diag-tf.json" <<'PY'
import json, sys
greedy, tf = (json.load(open(f)) for f in sys.argv[1:3])
g = next(v for k, v in greedy.items() if k.endswith("|eval"))["rows"]
t = next(v for k, v in tf.items() if k.endswith("|eval"))["rows"]
assert len(g) == len(t) == 3, (len(g), len(t))
for a, b in zip(g, t):
    assert a["correct"] == b["correct"] and a.get("first_wrong") == b.get("first_wrong"), (a, b)
print("diag_tasks --teacher-forced: same verdicts as greedy", [r["correct"] for r in t])
PY
# --families narrows every set to the named families; an unknown one is an error.
"$py" "$root/training/diag_tasks.py" --model "$work/run/final" --device cpu --teacher-forced \
  --families var_track,kv_table --lengths 1024 --per-cell 1 --limit 4 \
  --out "$work/diag-fam.json" > "$work/diag-fam.log"
"$py" - "$work/diag-fam.json" <<'PY'
import json, sys
rows = next(v for k, v in json.load(open(sys.argv[1])).items() if k.endswith("|eval"))["rows"]
assert len(rows) == 4 and {r["family"] for r in rows} == {"var_track", "kv_table"}, rows
print("diag_tasks --families: ok")
PY
if "$py" "$root/training/diag_tasks.py" --model "$work/run/final" --device cpu \
    --families var_trak --out "$work/diag-bad.json" 2> "$work/diag-bad.err"; then
  echo "diag_tasks accepted an unknown family"; exit 1; fi
grep -q "^--families: unknown var_trak" "$work/diag-bad.err"
