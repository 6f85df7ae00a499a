#!/usr/bin/env bash
# The GPU machine's suite, in one command (device tool; see docs/benchmarks.md):
#   1. the server bundle (.pack/ctxcache-server.tar.xz from scripts/pack-server.sh,
#      carried) starts on that host and answers health;
#   2. the Python package installs and its tests pass against the bundled
#      ctxcached with that host's grpcio / protobuf (CTXCACHE_PYTEST_ARGS:
#      which tests, relative to python/; default all);
#   3. python/bench/gpu_decode_attention.py (decode attention vs SDPA flash);
#   4. python/bench/hf_decode.py: HF transformers prefill + ingest + sparse
#      decode through ctxcached, against dense and the C++ worker;
#   4b. data_plane: python/bench/gpu_load.py (the data plane's targets: bulk
#      load, cold load, TTFT from the cache vs HF prefill, ingest);
#   4c. page_fetch: python/bench/page_fetch.py (a step's scattered pages,
#      framed and per page, against a bulk load; CTXCACHE_PAGE_FETCH_ARGS);
#   4d. gpu_engine: python/bench/gpu_engine.py (the engine's decode step,
#      sparse against dense in one process; each of the ';'-separated
#      argument lists in CTXCACHE_ENGINE_RUNS one run, gpu_engine-I.json;
#      default the 8B shape at 32K, batch 1, fused and module steps);
#   5. python/bench/gpu_e2e.py (stage gpu_e2e): a 32K context, HF's dense
#      decoding with the KV loaded from ctxcached against hf.generate_engine
#      (dense and sparse, a 10% HBM page pool), on the reference model and
#      on the Llama-3-8B shape (random weights,
#      CTXCACHE_E2E_LAYERS layers, default 8). CTXCACHE_E2E_MODELS=ref or
#      llama8b runs one of them; CTXCACHE_E2E_ARGS adds flags to both (e.g.
#      --profile-steps 8: a torch.profiler + cProfile breakdown, *-profile.json).
#   6. cluster_bench (needs the install stage first, and a pack made with
#      CTXCACHE_PACK_ETCD=1): bench/cluster/cluster_scaling.py, 1/2/3 nodes
#      pinned to 2 cores each, the C++ load generator on the rest
#      (CTXCACHE_CLUSTER_BENCH_ARGS adds flags).
#   7. tasks (needs a pack made with CTXCACHE_PACK_BENCH=1): the long-context
#      task suite (ctxcache-bench tasks, docs/benchmarks.md "Long-context
#      tasks") on the host's CPUs, CTXCACHE_TASKS_SHARDS (default 8) processes
#      side by side, each with its own ctxcached, on CTXCACHE_TASKS_FILE (JSONL
#      from evals/longctx_tasks.py, carried; default build/tasks/tasks.jsonl);
#      CTXCACHE_TASKS_SECONDS (default 540) bounds it. $OUT/tasks.tgz holds
#      each shard's JSON (tasks-I.json, every task it finished) and log.
#   8. serve_cb: python/bench/serve_cb.py, transformers' continuous batching
#      with and without ctxcache as its prefix store (greedy tokens against
#      plain generate_batch, TTFT, throughput); CTXCACHE_SERVE_ARGS (default
#      --quick) picks the workload.
# Writes logs and JSON under $OUT (default ./gpu-out). Each stage has its own
# time limit; a failed stage is recorded and the next one still runs.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 1
OUT="${OUT:-$PWD/gpu-out}"
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
status=0
stage() {  # stage NAME SECONDS CMD...; CTXCACHE_GPU_STAGES=a,b runs only those
  local name="$1" secs="$2"
  shift 2
  if [ -n "${CTXCACHE_GPU_STAGES:-}" ] && [[ ",$CTXCACHE_GPU_STAGES," != *",$name,"* ]]; then
    echo "== $name skipped"
    return
  fi
  echo "== $name"
  timeout "$secs" "$@" >"$OUT/$name.log" 2>&1
  local rc=$?
  echo "$name rc=$rc" | tee -a "$OUT/stages.txt"
  tail -5 "$OUT/$name.log"
  [ $rc -eq 0 ] || status=1
}
WORK="$(mktemp -d /tmp/ctxcache-gpu-XXXXXX)"
tar -xJf .pack/ctxcache-server.tar.xz -C "$WORK"
mkdir -p "$WORK/bin"
for b in ctxcached ctxcache ctxcache-cluster-load ctxcache-bench fio; do  # wrappers named like the binaries
  [ -x "$WORK/ctxcache/bin/$b" ] || continue
  printf '#!/usr/bin/env bash\nexec %s/ctxcache/bin/%s.sh "$@"\n' "$WORK" "$b" >"$WORK/bin/$b"
  chmod +x "$WORK/bin/$b"
done
./scripts/unpack-models.sh >/dev/null
# The native client library of the bundle (python/ctxcache/native.py).
export CTXCACHE_NATIVE_LIB="$WORK/ctxcache/lib/libctxcache_c.so"
# The bundle's fio (CTXCACHE_PACK_FIO=1), where the host has none.
command -v fio >/dev/null || export PATH="$WORK/bin:$PATH"

stage bundle 120 bash -c "
  '$WORK/bin/ctxcached' --data-dir '$WORK/data' --listen 127.0.0.1:0 --port-file '$WORK/ports' \
    --metrics-listen '' --model-dir models --default-model ctxcache-ref >'$WORK/server.log' 2>&1 &
  pid=\$!
  for i in \$(seq 1 100); do [ -s '$WORK/ports' ] && break; sleep 0.2; done
  port=\$(head -1 '$WORK/ports' | tr -dc 0-9)
  '$WORK/bin/ctxcache' health --server 127.0.0.1:\$port && kill -TERM \$pid && wait \$pid"
stage install 120 bash -c "
  python3 -m pip install -q --no-index --no-build-isolation --no-deps --target '$WORK/site' ./python &&
  PYTHONPATH='$WORK/site' python3 -c 'import ctxcache, grpc, google.protobuf as p; print(ctxcache.__file__, grpc.__version__, p.__version__)'"
stage python_tests 400 bash -c "
  cd python && PYTHONPATH='$WORK/site' CTXCACHE_BIN_DIR='$WORK/bin' CTXCACHE_HF_TESTS=1 python3 -m pytest \${CTXCACHE_PYTEST_ARGS:-tests} -q -p no:cacheprovider \
    --model-dir ../tests/data/golden"
stage gpu_decode_attention 400 python3 python/bench/gpu_decode_attention.py \
  --out "$OUT/gpu_decode_attention.json"
# 4. HF transformers end to end: prefill + ingest + sparse decode against the
#    bundled ctxcached (python/bench/hf_decode.py), and the C++ reference
#    worker's csa agreement on the same document and prompt, for comparison.
PROMPT=$'\n\n   Truncate the file corresponding to file descriptor'
stage hf_decode 500 bash -c "
  '$WORK/bin/ctxcached' --data-dir '$WORK/data-hf' --listen 127.0.0.1:0 --port-file '$WORK/ports-hf' \
    --metrics-listen '' --model-dir models --default-model ctxcache-ref >'$WORK/server-hf.log' 2>&1 &
  pid=\$!
  for i in \$(seq 1 100); do [ -s '$WORK/ports-hf' ] && break; sleep 0.2; done
  addr=127.0.0.1:\$(head -1 '$WORK/ports-hf' | tr -dc 0-9)
  '$WORK/bin/ctxcache' tokenize --model-dir models --model ctxcache-ref \
    --file tests/data/demo/document.txt --text \"\$1\" >'$WORK/tokens.json' &&
  PYTHONPATH='$WORK/site' python3 python/bench/hf_decode.py --server \$addr \
    --tokens-json '$WORK/tokens.json' --n-new \${CTXCACHE_HF_NEW:-32} --out '$OUT/hf_decode.json' \
    \${CTXCACHE_HF_ARGS:-} &&
  id=\$('$WORK/bin/ctxcache' --server \$addr --json --timeout 600 build \
    --file tests/data/demo/document.txt | python3 -c 'import json,sys; print(json.loads(sys.stdin.read().splitlines()[-1])[\"context_id\"])') &&
  '$WORK/bin/ctxcache' --server \$addr --timeout 600 --json generate --context \$id --prompt \"\$1\" \
    --method csa --rho 0.05 --max-tokens 64 --compare full --model-dir models >'$OUT/cpp_worker_csa.json'
  rc=\$?
  kill -TERM \$pid; wait \$pid
  exit \$rc" _ "$PROMPT"
# 4b. The data plane's targets (python/bench/gpu_load.py): bulk load into
#     pinned memory, cold load against fio, time to first token from the
#     cache against HF prefill, ingest against prefill. CTXCACHE_LOAD_CASES
#     (MODEL:LAYERS:TOKENS, space-separated) picks the cases.
stage data_plane 590 bash -c "
  cat tests/data/demo/*.txt >'$WORK/long-dp.txt'
  '$WORK/bin/ctxcache' tokenize --model-dir models --model ctxcache-ref --file '$WORK/long-dp.txt' \
    >'$WORK/long-dp.json' || exit 1
  rc=0
  for c in \${CTXCACHE_LOAD_CASES:-models/ctxcache-ref:8:32768 llama8b:32:32768 llama8b:8:131072}; do
    # quest: the engine's index (the sparse time to first token reads it);
    # the reference model also gets its default index (csa).
    idx=streaming,quest; case \$c in models/*) idx=csa,quest;; esac
    PYTHONPATH='$WORK/site' python3 python/bench/gpu_load.py --bin-dir '$WORK/bin' --case \$c \
      --indexes \"\$idx\" --tokens-json '$WORK/long-dp.json' --work '$WORK/load' \
      --out '$OUT/gpu_load_'\$(echo \$c | tr -c 'a-z0-9\n' _).json \${CTXCACHE_LOAD_ARGS:-} || rc=1
  done
  exit \$rc"
# 4c. A decode step's scattered pages through the native library (framed
#     FetchKV with page tables, per-page FetchPages) against a bulk load,
#     on one ctxcached over loopback (python/bench/page_fetch.py).
stage page_fetch 300 bash -c "
  PYTHONPATH='$WORK/site' python3 python/bench/page_fetch.py --bin-dir '$WORK/bin' \
    \${CTXCACHE_PAGE_FETCH_ARGS:---tokens 131072 --layers 4 --streams 1,8,16} >'$OUT/page_fetch.json'"
# 4d. The engine's decode step (python/bench/gpu_engine.py), one process a run.
stage gpu_engine 560 bash -c "
  cd python/bench && i=0 && rc=0 &&
  IFS=';' read -ra runs <<< \"\${CTXCACHE_ENGINE_RUNS:---layers 32 --tokens 32768 --kv prefill \
--batches 1 --periods 1,4 --steps-kind fused,modules}\" &&
  for r in \"\${runs[@]}\"; do
    i=\$((i + 1))
    PYTHONPATH='$WORK/site' python3 gpu_engine.py \$r >'$OUT/gpu_engine-'\$i.json || rc=1
  done; exit \$rc"
# 5. End to end at 32K (python/bench/gpu_e2e.py), one server for both models.
stage gpu_e2e 560 bash -c "
  '$WORK/bin/ctxcached' --data-dir '$WORK/data-e2e' --listen 127.0.0.1:0 --port-file '$WORK/ports-e2e' \
    --metrics-listen '' --model-dir models --default-model ctxcache-ref --max-context-tokens 140000 --session-memory-mb 65536 \
    >'$WORK/server-e2e.log' 2>&1 &
  pid=\$!
  for i in \$(seq 1 100); do [ -s '$WORK/ports-e2e' ] && break; sleep 0.2; done
  addr=127.0.0.1:\$(head -1 '$WORK/ports-e2e' | tr -dc 0-9)
  cat tests/data/demo/*.txt >'$WORK/long.txt'
  '$WORK/bin/ctxcache' tokenize --model-dir models --model ctxcache-ref --file '$WORK/long.txt' \
    >'$WORK/long.json'
  rc=\$?
  case \",\${CTXCACHE_E2E_MODELS:-ref,llama8b},\" in *,ref,*)
    PYTHONPATH='$WORK/site' python3 python/bench/gpu_e2e.py --server \$addr --model models/ctxcache-ref \
      --tokens-json '$WORK/long.json' --tokens \${CTXCACHE_E2E_TOKENS:-32768} --out '$OUT/gpu_e2e_ref.json' \
      --profile-out '$OUT/gpu_e2e_ref-profile.json' \${CTXCACHE_E2E_ARGS:-} || rc=1;;
  esac
  case \",\${CTXCACHE_E2E_MODELS:-ref,llama8b},\" in *,llama8b,*)
    PYTHONPATH='$WORK/site' python3 python/bench/gpu_e2e.py --server \$addr --model llama8b \
      --layers \${CTXCACHE_E2E_LAYERS:-8} --tokens \${CTXCACHE_E2E_TOKENS:-32768} --out '$OUT/gpu_e2e_llama8b.json' \
      --profile-out '$OUT/gpu_e2e_llama8b-profile.json' \${CTXCACHE_E2E_ARGS:-} || rc=1;;
  esac
  kill -TERM \$pid; wait \$pid
  echo \"ctxcached exit status: \$?\" >>'$WORK/server-e2e.log'
  [ \$rc -eq 0 ] || tail -200 '$WORK/server-e2e.log' >'$OUT/gpu_e2e-server-tail.log'
  exit \$rc"
# 6. Cluster read scaling (bench/cluster/cluster_scaling.py).
stage cluster_bench 900 bash -c "
  CTXCACHE_ETCD_BIN='$WORK/ctxcache/bin/etcd' PYTHONPATH='$WORK/site' \
    python3 bench/cluster/cluster_scaling.py --bin-dir '$WORK/bin' --model-dir tests/data/golden \
    --out '$OUT/cluster_bench.json' \${CTXCACHE_CLUSTER_BENCH_ARGS:-}"
# 7. The task suite on the host's CPUs, sharded (bench/plot_tasks.py merges).
stage tasks "${CTXCACHE_TASKS_SECONDS:-540}" bash -c "
  n=\${CTXCACHE_TASKS_SHARDS:-8}
  d='$WORK/tasks'
  mkdir -p \$d
  pack() { tar czf '$OUT/tasks.tgz' -C \$d .; }  # one file: the device returns few files
  trap 'kill \$(jobs -p) 2>/dev/null; sleep 1; pack; exit 124' TERM
  for i in \$(seq 0 \$((n - 1))); do
    '$WORK/bin/ctxcache-bench' tasks --tasks \${CTXCACHE_TASKS_FILE:-build/tasks/tasks.jsonl} \
      --shard \$i/\$n --out \$d/tasks-\$i.json \${CTXCACHE_TASKS_ARGS:-} \
      >\$d/tasks-\$i.txt 2>\$d/tasks-\$i.err &
  done
  rc=0
  for j in \$(jobs -p); do wait \$j || rc=1; done
  pack
  exit \$rc"
# 8. Continuous batching with and without ctxcache (python/bench/serve_cb.py).
stage serve_cb 900 bash -c "
  PYTHONPATH='$WORK/site' CTXCACHE_BIN_DIR='$WORK/bin' python3 python/bench/serve_cb.py \
    --out '$OUT/serve_cb.json' \${CTXCACHE_SERVE_ARGS:---quick}"
exit $status
