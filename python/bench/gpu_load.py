"""The data plane's targets on a GPU host (issue "The data plane", the
scripts/gpu-suite.sh stage data_plane): how fast a stored context reaches
the GPU through the native library (python/ctxcache/native.py), against
recomputing it, with the baselines measured in the same run.

For each ``--case MODEL:LAYERS:TOKENS`` (MODEL = ``llama8b`` for the
Llama-3-8B shape with random bf16 weights, or an HF checkpoint directory):
1. baselines: one-thread memcpy and pinned host-to-GPU copy rates (1 GiB);
2. HF prefill of the context (``--tokens-json`` document repeated, or random
   ids), timed to its first token: the recompute time to beat;
3. ingest of the prefill's post-RoPE K/V/Q with ``--indexes``, through the
   native library (``--ingest-client native``, the default) or the Python
   gRPC client (ingest tokens/s; the ingest goal is "no longer than the
   prefill"); then, with ``--ingest-overlap 1`` (the default), the prefill
   and ingest overlapped (``hf.prefill_and_ingest(overlap=True)``: each
   layer's K/V sent as the forward computes it) on the tokens rotated by
   one: the forward's time and how long after it the context is READY;
4. bulk load of every layer into pinned host memory (``--streams`` sweep):
   GB/s, warm store;
5. cold load: the same after ``echo 3 > /proc/sys/vm/drop_caches`` (when
   permitted) and a ctxcached restart (so RocksDB's block cache is empty);
6. time to first token from the cache: load into pinned memory, each layer
   copied to the GPU as soon as it lands (``wait_layer``), then one decode
   step with the model's own SDPA (flash) attention over the KV; against (2);
7. time to first token from the worker's pinned host tier: the context
   already loaded there (by 4-6), copied to the GPU, then one decode step;
8. the same host through shared memory (MapKV, ``engine.MappedKV``): the
   first call has the server fill a sealed memfd segment, which it keeps
   (``--shm-cache-mb``); later calls map the kept segment. Each layer is
   registered with CUDA on ``--register-threads`` threads and copied to the
   GPU once registered, or copied into the pinned buffers of (4) (a
   worker's pinned arena) and from there to the GPU; then one decode step;
9. sparse time to first token (when the context has a ``quest`` index, e.g.
   ``--indexes streaming,quest``): ``hf.generate_engine(on_demand=True)``,
   the planner's index read from the stored Quest artifacts (FetchIndex)
   and the first step's pages fetched as each layer plans them
   (FetchPagesInto), through the same loopback gRPC as (6); against (6)
   and (8). Two calls, the first compiling the engine's kernels.

Prints JSON (and writes ``--out``).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from gpu_e2e import SDPA_BACKENDS, load_model, prefill_first_token  # noqa: E402

T0 = time.perf_counter()


def log(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f} s] {msg}", file=sys.stderr, flush=True)


def baselines() -> dict:
    n = 1 << 30
    src = torch.empty(n, dtype=torch.uint8)
    src.fill_(1)
    dst = torch.empty_like(src)
    torch.set_num_threads(1)
    dst.copy_(src)
    t = time.perf_counter()
    for _ in range(3):
        dst.copy_(src)
    memcpy = 3 * n / (time.perf_counter() - t) / 1e9
    torch.set_num_threads(os.cpu_count() or 1)
    pinned = torch.empty(n, dtype=torch.uint8).pin_memory()
    gpu = torch.empty(n, dtype=torch.uint8, device="cuda")
    gpu.copy_(pinned, non_blocking=True)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(3):
        gpu.copy_(pinned, non_blocking=True)
    torch.cuda.synchronize()
    h2d = 3 * n / (time.perf_counter() - t) / 1e9
    return {"memcpy_1thread_gb_per_s": memcpy, "h2d_pinned_gb_per_s": h2d}


def fio_randread(path: str) -> dict:
    """fio 16 KiB random reads at QD32 on the data dir's disk (absent: skipped)."""
    try:
        out = subprocess.run(
            ["fio", "--name=r", f"--directory={path}", "--rw=randread", "--bs=16k",
             "--iodepth=32", "--ioengine=libaio", "--direct=1", "--size=2g", "--runtime=15",
             "--time_based", "--output-format=json"], capture_output=True, text=True, timeout=120)
        job = json.loads(out.stdout)["jobs"][0]["read"]
        return {"fio_randread_qd32_gb_per_s": job["bw_bytes"] / 1e9}
    except Exception as e:  # noqa: BLE001
        return {"fio": f"skipped ({type(e).__name__}: {e})"[:200]}


def cache_kv(cache, layer: int):
    if hasattr(cache, "layers"):
        return cache.layers[layer].keys, cache.layers[layer].values
    return cache.key_cache[layer], cache.value_cache[layer]


@torch.no_grad()
def first_step(model, cache, tok: int, position: int) -> int:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    with sdpa_kernel([getattr(SDPBackend, SDPA_BACKENDS["flash"])]):
        out = model(input_ids=torch.tensor([[tok]], device="cuda"), past_key_values=cache,
                    use_cache=True, position_ids=torch.tensor([[position]], device="cuda"))
    return int(torch.argmax(out.logits[0, -1]))


def start_server(bin_dir: str, data: str, log_path: str, shm_cache_mb: int = 0) -> tuple:
    ports = data + ".ports"
    if os.path.exists(ports):
        os.remove(ports)
    proc = subprocess.Popen(
        [os.path.join(bin_dir, "ctxcached"), "--data-dir", data, "--listen", "127.0.0.1:0",
         "--port-file", ports, "--metrics-listen", "", "--model-dir", "models",
         "--default-model", "ctxcache-ref", "--max-context-tokens", "140000",
         "--session-memory-mb", "65536", "--shm-cache-mb", str(shm_cache_mb)],
        stdout=open(log_path, "ab"), stderr=subprocess.STDOUT)
    for _ in range(300):
        if os.path.exists(ports) and os.path.getsize(ports) > 0:
            break
        time.sleep(0.1)
    port = open(ports).read().split()[0]
    return proc, f"127.0.0.1:{port}"


def stop_server(proc) -> None:
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=60)


def sparse_ttft(a, case: dict, nc, model, info, tok: int) -> None:
    """Step 9 (module docstring): one sequence's first token from the stored
    Quest index and the first step's pages only."""
    from ctxcache.engine import EngineOptions
    from ctxcache.torch import hf
    opts = EngineOptions(rho=a.sparse_rho, rank="max", min_budget=1024)
    unit_bytes = 2 * 16 * hf.model_heads(model)[3] * 2
    for attempt in ("1", "2"):
        torch.cuda.synchronize()
        r = hf.generate_engine(nc, model, info, [tok], 1, on_demand=True, native=nc,
                               options=opts)
        case[f"sparse_ttft_{attempt}_s"] = r.ttft_s
        # Before the first step: the tier and the planner (the index loads beside the step).
        case[f"sparse_ttft_{attempt}_start_s"] = r.load_s
        case[f"sparse_ttft_{attempt}_setup_s"] = r.setup_s
        case[f"sparse_ttft_{attempt}_start"] = r.start
        log(f"sparse TTFT ({attempt}): {r.ttft_s:.3f} s (start {r.load_s:.3f} s: {r.start}, "
            f"set-up {r.setup_s:.3f} s, first step {r.first_step_units} units)")
    case["sparse_ttft_rho"] = a.sparse_rho
    case["sparse_first_step_gib"] = r.first_step_units * unit_bytes / 2**30
    best = min(case["sparse_ttft_1_s"], case["sparse_ttft_2_s"])
    case["sparse_ttft_s"] = best
    case["sparse_over_dense_fetchkv_ttft"] = best / min(case["cache_ttft_warm_s"],
                                                       case["cache_ttft_warm2_s"])
    log(f"sparse TTFT {best:.3f} s: {case['sparse_over_dense_fetchkv_ttft']:.3f} of the dense "
        f"TTFT from the cache (FetchKV)")


def ingest_overlapped(addr: str, model, ids: list, indexes: list, with_q: bool, case: dict,
                      prefill_s: float) -> None:
    """hf.prefill_and_ingest(overlap=True) through the native library: one
    forward whose layers go to the ingest as they are computed. The tokens
    are rotated by one (another context id: the same tokens would be reused)."""
    from ctxcache import native
    from ctxcache.torch import hf
    rotated = ids[1:] + ids[:1]
    with native.NativeClient(addr, timeout=3600) as nci:
        info, pre = hf.prefill_and_ingest(nci, model, rotated, indexes=indexes or None,
                                          name="gpu-load-overlap", overlap=True,
                                          send_q=with_q)
    case["overlap_forward_s"] = pre.seconds
    case["overlap_ingest_s"] = pre.ingest_s
    case["overlap_ready_after_prefill_s"] = pre.ready_after_prefill_s
    case["overlap_ready_from_prefill_start_s"] = pre.seconds + pre.ready_after_prefill_s
    case["overlap_ready_over_prefill"] = case["overlap_ready_from_prefill_start_s"] / prefill_s
    case["overlap_n_tokens"] = info.n_tokens
    log(f"overlapped prefill + ingest: forward {pre.seconds:.2f} s, READY "
        f"{pre.ready_after_prefill_s:.2f} s after it ({case['overlap_ready_over_prefill']:.2f}x "
        f"the plain prefill from its start)")
    del pre
    torch.cuda.empty_cache()


def run_case(a, spec: str, res: dict) -> None:
    import ctxcache
    from ctxcache import native
    from ctxcache.torch import hf
    name, layers, tokens = spec.split(":")
    layers, tokens = int(layers), int(tokens)
    case = {"model": name, "layers": layers, "tokens": tokens}
    res["cases"].append(case)
    log(f"case {spec}: loading the model")
    model = load_model(name, layers, "cuda")
    cfg = model.config
    case["layers"] = cfg.num_hidden_layers
    if a.tokens_json and name != "llama8b":
        doc = [int(x) for x in json.load(open(a.tokens_json))]
        ids = (doc * (tokens // len(doc) + 2))[:tokens]
    else:
        g = torch.Generator().manual_seed(7)
        ids = torch.randint(3, cfg.vocab_size, (tokens,), generator=g).tolist()
    data = os.path.join(a.work, f"data-{len(res['cases'])}")
    proc, addr = start_server(a.bin_dir, data, os.path.join(a.work, "server.log"),
                              a.shm_cache_mb)
    try:
        prefill_first_token(model, ids[:1024])  # warm-up (kernels, allocator)
        prefill_s, cache, tok = prefill_first_token(model, ids)
        case["hf_prefill_ttft_s"] = prefill_s
        log(f"HF prefill to the first token: {prefill_s:.2f} s")
        del cache
        torch.cuda.empty_cache()
        with ctxcache.Client(addr, timeout=3600) as c:
            indexes = [x for x in a.indexes.split(",") if x]
            pre = hf.prefill(model, ids)
            spec = hf.model_spec(model, "hf:" + os.path.basename(name.rstrip("/")))
            # Q only where an index needs it (csa, tactic, lfps; "" = the server's defaults).
            with_q = not indexes or any(x not in ("streaming", "quest", "full", "oracle")
                                        for x in indexes)
            layers_kvq = ((pre.k[i], pre.v[i]) + ((pre.q[i],) if with_q else ())
                          for i in range(len(pre.k)))
            t = time.perf_counter()
            if a.ingest_client == "native":
                with native.NativeClient(addr, timeout=3600) as nci:
                    info = nci.ingest(spec, ids, layers_kvq, indexes=indexes or None,
                                      name="gpu-load")
            else:
                info = c.ingest(spec, ids, layers_kvq, indexes=indexes or None, name="gpu-load")
            case["ingest_s"] = time.perf_counter() - t
            case["ingest_client"] = a.ingest_client
            case["indexes"] = indexes or "server defaults"
            case["ingest_sends_q"] = with_q
            case["ingest_tokens_per_s"] = tokens / case["ingest_s"]
            case["ingest_over_prefill"] = case["ingest_s"] / prefill_s
            del pre
            torch.cuda.empty_cache()
            if a.ingest_overlap:
                ingest_overlapped(addr, model, ids, indexes, with_q, case, prefill_s)
        log(f"ingested in {case['ingest_s']:.1f} s")
        nc = native.NativeClient(addr, timeout=600)
        shape = nc.context(info.context_id)
        k = torch.empty(shape.kv_shape(), dtype=torch.bfloat16).pin_memory()
        v = torch.empty_like(k).pin_memory()
        case["kv_gib"] = 2 * k.numel() * 2 / 2**30
        loads = {}
        for streams in [int(s) for s in a.streams.split(",")]:
            p = nc.load_kv(info.context_id, k, v, streams=streams, frame_bytes=a.frame_bytes)
            loads[str(streams)] = p["gb_per_s"]
            log(f"warm load, {streams} streams: {p['gb_per_s']:.2f} GB/s ({p['seconds']:.2f} s)")
        case["warm_load_gb_per_s_by_streams"] = loads
        best = max(loads, key=loads.get)
        case["warm_load_gb_per_s"] = loads[best]
        streams = int(best)

        # Time to first token from the cache: each layer to the GPU as it lands.
        from transformers import DynamicCache
        n = shape.n_tokens
        gk = torch.empty((shape.n_layers, 1, shape.n_kv_heads, n, shape.head_dim),
                         dtype=torch.bfloat16, device="cuda")
        gv = torch.empty_like(gk)
        for attempt in ("warm", "warm2"):
            torch.cuda.synchronize()
            t = time.perf_counter()
            with nc.start_load_kv(info.context_id, k, v, streams=streams,
                                  frame_bytes=a.frame_bytes) as load:
                for layer in range(shape.n_layers):
                    load.wait_layer(layer)
                    gk[layer, 0].copy_(k[layer], non_blocking=True)
                    gv[layer, 0].copy_(v[layer], non_blocking=True)
                load.wait()
            cache = DynamicCache()
            for layer in range(shape.n_layers):
                cache.update(gk[layer], gv[layer], layer)
            torch.cuda.synchronize()
            loaded = time.perf_counter() - t
            first_step(model, cache, ids[-1], n)
            torch.cuda.synchronize()
            ttft = time.perf_counter() - t
            case[f"cache_ttft_{attempt}_s"] = ttft
            case[f"cache_ttft_{attempt}_load_to_gpu_s"] = loaded
            del cache
            log(f"TTFT from the cache ({attempt}): {ttft:.3f} s (KV on the GPU after "
                f"{loaded:.3f} s); HF prefill {prefill_s:.2f} s: {prefill_s / ttft:.1f}x")
        case["ttft_speedup_vs_prefill"] = prefill_s / min(case["cache_ttft_warm_s"],
                                                          case["cache_ttft_warm2_s"])
        if "quest" in indexes:
            sparse_ttft(a, case, nc, model, info, ids[-1])
        # The context already in the worker's pinned host tier (the loads above
        # left it there): the time to first token is the copy to the GPU and a step.
        for attempt in ("1", "2"):
            torch.cuda.synchronize()
            t = time.perf_counter()
            gk[:, 0].copy_(k, non_blocking=True)
            gv[:, 0].copy_(v, non_blocking=True)
            cache = DynamicCache()
            for layer in range(shape.n_layers):
                cache.update(gk[layer], gv[layer], layer)
            first_step(model, cache, ids[-1], n)
            torch.cuda.synchronize()
            case[f"host_tier_ttft_{attempt}_s"] = time.perf_counter() - t
            del cache
        case["host_tier_speedup_vs_prefill"] = prefill_s / min(case["host_tier_ttft_1_s"],
                                                               case["host_tier_ttft_2_s"])
        log(f"TTFT from the pinned host tier: {case['host_tier_ttft_2_s']:.3f} s "
            f"({case['host_tier_speedup_vs_prefill']:.1f}x the prefill)")
        # Same host through shared memory (MapKV, engine.MappedKV). "fill":
        # the first MapKV fills the segment, which the server keeps
        # (--shm-cache-mb); "kept*": later calls map the kept segment,
        # registered with CUDA layer by layer on --register-threads threads
        # ("kept", "kept2") or copied layer by layer into the pinned buffers
        # k, v (a worker's pinned arena, allocated once; "kept_copy*") while
        # the previous layer goes to the GPU. The step runs while the
        # mapping is held.
        from ctxcache.engine import MappedKV
        for attempt in ("fill", "kept", "kept2", "kept_copy", "kept_copy2"):
            copy = attempt.startswith("kept_copy")
            torch.cuda.synchronize()
            t = time.perf_counter()
            with MappedKV(nc, info.context_id, register_threads=a.register_threads,
                          register=not copy) as m:
                t_mapped = time.perf_counter() - t
                for layer in range(shape.n_layers):
                    lk, lv = m.layer(layer)
                    if copy:
                        k[layer].copy_(lk)
                        v[layer].copy_(lv)
                        lk, lv = k[layer], v[layer]
                    gk[layer, 0].copy_(lk, non_blocking=True)
                    gv[layer, 0].copy_(lv, non_blocking=True)
                torch.cuda.synchronize()
                on_gpu = time.perf_counter() - t
                cache = DynamicCache()
                for layer in range(shape.n_layers):
                    cache.update(gk[layer], gv[layer], layer)
                first_step(model, cache, ids[-1], n)
                torch.cuda.synchronize()
                ttft = time.perf_counter() - t
                del cache
            case[f"shm_ttft_{attempt}_s"] = ttft
            case[f"shm_{attempt}_on_gpu_s"] = on_gpu
            case[f"shm_{attempt}_mapped_after_s"] = t_mapped
            log(f"TTFT through shared memory ({attempt}): {ttft:.3f} s (KV on the GPU after "
                f"{on_gpu:.3f} s, {case['kv_gib'] * 2**30 / on_gpu / 1e9:.2f} GB/s); "
                f"{prefill_s / ttft:.1f}x the prefill")
        case["cpu_copy_threads"] = torch.get_num_threads()
        case["shm_register_threads"] = a.register_threads
        case["shm_cache_mb"] = a.shm_cache_mb
        # The fill bounds the first call's time to the GPU.
        case["shm_fill_gb_per_s_at_least"] = (case["kv_gib"] * 2**30
                                              / case["shm_fill_on_gpu_s"] / 1e9)
        case["shm_ttft_speedup_vs_prefill"] = prefill_s / case["shm_ttft_fill_s"]
        case["shm_kept_ttft_speedup_vs_prefill"] = prefill_s / min(
            case["shm_ttft_kept_s"], case["shm_ttft_kept2_s"])
        case["shm_kept_copy_ttft_speedup_vs_prefill"] = prefill_s / min(
            case["shm_ttft_kept_copy_s"], case["shm_ttft_kept_copy2_s"])
        if "sparse_ttft_s" in case:
            case["sparse_over_dense_shm_kept_ttft"] = case["sparse_ttft_s"] / min(
                case["shm_ttft_kept_s"], case["shm_ttft_kept2_s"], case["shm_ttft_kept_copy_s"],
                case["shm_ttft_kept_copy2_s"])
        log(f"TTFT through a kept segment: {case['shm_kept_ttft_speedup_vs_prefill']:.1f}x "
            f"the prefill registered, {case['shm_kept_copy_ttft_speedup_vs_prefill']:.1f}x "
            f"copied into pinned buffers")
        nc.close()
        # Cold: restart the server (empty block cache) and drop the OS page cache.
        stop_server(proc)
        try:
            subprocess.run(["sync"], check=True)
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("3\n")
            case["cold_drop_caches"] = True
        except OSError as e:
            case["cold_drop_caches"] = f"not permitted ({e.strerror})"
        proc, addr = start_server(a.bin_dir, data, os.path.join(a.work, "server.log"))
        with native.NativeClient(addr, timeout=600) as nc2:
            p = nc2.load_kv(info.context_id, k, v, streams=streams, frame_bytes=a.frame_bytes)
            case["cold_load_gb_per_s"] = p["gb_per_s"]
            log(f"cold load: {p['gb_per_s']:.2f} GB/s")
        case.update(fio_randread(data))
        if "fio_randread_qd32_gb_per_s" in case:
            case["cold_over_fio"] = case["cold_load_gb_per_s"] / case["fio_randread_qd32_gb_per_s"]
        del gk, gv, k, v
    finally:
        stop_server(proc)
        del model
        torch.cuda.empty_cache()
        subprocess.run(["rm", "-rf", data])


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin-dir", required=True, help="folder holding ctxcached")
    ap.add_argument("--case", action="append", required=True,
                    help="MODEL:LAYERS:TOKENS (MODEL llama8b or a checkpoint dir; LAYERS "
                         "applies to llama8b)")
    ap.add_argument("--tokens-json", default="", help="a document's token ids (checkpoints)")
    ap.add_argument("--indexes", default="streaming",
                    help="indexes to build at ingest (comma-separated; '' = server defaults)")
    ap.add_argument("--streams", default="1,4,8,16", help="warm-load stream counts to try")
    ap.add_argument("--ingest-overlap", type=int, default=1,
                    help="1: also prefill and ingest overlapped (hf.prefill_and_ingest "
                         "overlap=True) on the tokens rotated by one")
    ap.add_argument("--ingest-client", default="native", choices=("native", "grpc"),
                    help="the ingest's client: the native library or the Python gRPC client")
    ap.add_argument("--frame-bytes", type=int, default=0, help="FetchKV frame size (0 = 4 MiB)")
    ap.add_argument("--shm-cache-mb", type=int, default=24576,
                    help="ctxcached --shm-cache-mb: host memory keeping MapKV segments")
    ap.add_argument("--register-threads", type=int, default=4,
                    help="threads registering mapped layers with CUDA (engine.MappedKV)")
    ap.add_argument("--sparse-rho", type=float, default=0.05,
                    help="sparse TTFT: the engine's page budget (rank max, floor 1024 tokens)")
    ap.add_argument("--work", default="/tmp/ctxcache-gpu-load")
    ap.add_argument("--out", default="")
    a = ap.parse_args()
    os.makedirs(a.work, exist_ok=True)
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "cpus": os.cpu_count(), "baselines": baselines(), "cases": []}
    log(f"baselines: {res['baselines']}")
    rc = 0
    for spec in a.case:
        try:
            run_case(a, spec, res)
        except Exception as e:  # noqa: BLE001 - record and go on to the next case
            import traceback
            traceback.print_exc()
            res["cases"].append({"case": spec, "error": f"{type(e).__name__}: {e}"})
            rc = 1
        if a.out:
            with open(a.out, "w") as f:
                json.dump(res, f, indent=1)
    print(json.dumps(res, indent=1))
    return rc


if __name__ == "__main__":
    sys.exit(main())
