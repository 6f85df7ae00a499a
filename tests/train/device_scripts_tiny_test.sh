#!/usr/bin/env bash
# The GPU-machine scripts (training/device_run.sh, device_sweep.sh) end to
# end on the CPU with their TINY=1 2-layer model, in a temp folder, from a
# small corpus made of the demo documents: the dry run (prep, smoke test,
# training, finish), a sweep round of device_sweep.sh's default variants (the
# next run's recipe, with a staged extra-train file), a second round chained on
# "this machine" with TUNE_INIT=last-best, and that a fresh machine's
# last-best exits 3. Run it before spending device time on a changed script
# (~2-3 minutes; opt-in: cmake -DCTXCACHE_DEVICE_SCRIPTS=ON, ctest -L device_scripts).
#   tests/train/device_scripts_tiny_test.sh REPO_ROOT
set -euo pipefail
root="$1"
py=/usr/bin/python3
if ! "$py" -c "import torch, numpy, sentencepiece" 2>/dev/null; then
  echo "python3-torch, python3-numpy or python3-sentencepiece missing; skipped"; exit 77
fi
work="$(mktemp -d)"
trap '[ -n "${KEEP_WORK:-}" ] || rm -rf "$work"' EXIT
cd "$root"
demo=tests/data/demo
export C="$work/carry"
mkdir -p "$C"
for f in vim_help r_admin linux_firmware_guide; do cat "$demo/$f.txt"; printf '\x1e\n'; done |
  xz -1 > "$C/train.txt.xz"
{ cat "$demo/document.txt"; printf '\x1e\n'; } > "$C/heldout.txt"
printf 'split\tname\tchars\nheldout\tpython3.11-doc/library#9\t%s\n' \
  "$(wc -c < "$demo/document.txt")" > "$C/docs.tsv"
cp models/ctxcache-ref/tokenizer.model "$C/"
export TINY=1
W="$work/tiny" OUT="$work/tiny/out" bash training/device_run.sh dry > "$work/dry.log" 2>&1 ||
  { tail -30 "$work/dry.log"; exit 1; }
grep -q "dry run passed" "$work/dry.log" || { tail -30 "$work/dry.log"; echo "no 'dry run passed'"; exit 1; }
test -f "$work/tiny/out/pack.tar"
export R="$work/sweep" SWEEP_MORE="" STOP_AT=900 STAGE="$work/stage"
mkdir -p "$STAGE"
{ cat "$demo/r_admin.txt"; printf '\x1e\n'; } | xz -1 > "$STAGE/train_extra.txt.xz"
TUNE_INIT="$work/tiny/run/final" OUT="$work/o1" \
  bash training/device_sweep.sh start > "$work/s1.log" 2>&1 || { tail -30 "$work/s1.log"; exit 1; }
best1=$(cat "$R/BEST")
# The default variants' task flags reached train.py prep.
names=$(grep -o '^started [a-z0-9]*' "$work/s1.log" | cut -d' ' -f2 | tr '\n' ' ')
test "$(echo $names | wc -w)" = 2 || { echo "default variants: '$names'"; exit 1; }
grep -q -- "--extra-train $STAGE/train_extra.txt.xz" "$work/s1.log"
# Each summary line splits var_track by the distractor chain's layout and has
# the 1-hop binding probe.
"$py" -c "
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith('{')]
for r in rows:
    after = r['var_track_after']
    assert after and sum(n for _, n in after.values()) > 0, r
    bind = r['bind1_late']  # var_track_attention.py's 1-hop probe, from finish
    assert bind and bind[1] == 20 and 0 <= bind[0] <= 20, r
" "$work/o1/summary16k.jsonl"
# collect: both evaluations, their 16K summary and the best one's weights.
test "$(grep -c '^{"variant"' "$work/o1/summary16k.jsonl")" = 2
test -f "$work/o1/packs.tar.xz" && test -f "$work/o1/$best1/small.tar"
ls "$work/o1/$best1"/*.safetensors.xz > /dev/null
# Round 2 on the same machine from round 1's pick, a variant reusing its name.
TUNE_INIT=last-best OUT="$work/o2" VARIANTS="$best1||
c||--lr 5e-4" bash training/device_sweep.sh start > "$work/s2.log" 2>&1 ||
  { tail -30 "$work/s2.log"; exit 1; }
grep -q "TUNE_INIT=last-best: $best1's weights" "$work/s2.log"
for n in "$best1" c; do
  grep -q "\"init_from\": \"$R/.init\"" "$R/$n/train.log" || { echo "$n did not start from .init"; exit 1; }
done
test "$(grep -c '^{"variant"' "$work/o2/summary16k.jsonl")" = 2
# A fresh machine has no earlier round: exit 3 at once.
set +e
R="$work/fresh" TUNE_INIT=last-best OUT="$work/o3" VARIANTS="a||" \
  bash training/device_sweep.sh start > "$work/s3.log" 2>&1
rc=$?
set -e
test "$rc" = 3 || { cat "$work/s3.log"; echo "fresh last-best: exit $rc, want 3"; exit 1; }
echo "device scripts (TINY): dry run, two rounds chained by last-best ($best1 -> .init), fresh machine exit 3"
