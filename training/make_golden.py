#!/usr/bin/env python3
"""Golden outputs for the C++ prefill engine, computed with HF transformers in fp32.

Two modes (run on the GPU machine, or on any machine with torch+transformers):

  python3 training/make_golden.py tiny --out tests/data/golden
      Four seeded random-init configs (llama3, qwen2, mistral, smollm). For each,
      <out>/<name>/{config.json, model.safetensors, golden.safetensors}.

  python3 training/make_golden.py ref --model models/ctxcache-ref \
      --input-text tests/data/demo/document.txt --out tests/data/golden/ctxcache-ref
      Logits for a fixed 512-token held-out input (<s> + the first 511 tokens of
      the text) and three greedy continuations with the trained reference model
      (bf16 weights upcast to fp32).

golden.safetensors layout (all tensors little-endian, contiguous):
  input_ids        I64 [T]
  logit_positions  I64 [P]
  logits           F32 [P, vocab]
  layer{i}.q       F32 [n_q_heads, T, head_dim]   post-RoPE query   (tiny configs;
  layer{i}.k       F32 [n_kv_heads, T, head_dim]  post-RoPE key      i = 0 and
  layer{i}.v       F32 [n_kv_heads, T, head_dim]  value              n_layers-1)
  prompt{j}_ids    I64 [len_j]   (ref only) prompt, starting with <s> (id 1)
  prompt{j}_greedy I64 [32]      (ref only) greedy continuation, no eos stop
"""
import argparse
import importlib
import json
import math
import os
import sys

import torch
from safetensors.torch import save_file
import transformers
from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                          Qwen2Config, Qwen2ForCausalLM)

T_TINY = 64

# Attention capture: a forward pre-hook on every self_attn module grabs its
# inputs (hidden_states and the (cos, sin) position embeddings); q/k/v are
# recomputed from them with the module's own projections and its family's
# apply_rotary_pos_emb. A forward hook then recomputes the attention output from
# the captured q/k/v (causal softmax, GQA repeat, o_proj) and checks it against
# what the module returned.
CAPTURE = {}
CHECK = {"max_err": 0.0}


def _reference_attention(q, k, v, scaling):
    # q [B,Hq,T,D], k/v [B,Hkv,T,D] -> [B,T,Hq*D]
    rep = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(rep, dim=1)
    v = v.repeat_interleave(rep, dim=1)
    s = torch.matmul(q, k.transpose(-1, -2)) * scaling
    t = q.shape[2]
    mask = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    s = s.masked_fill(~mask, float("-inf"))
    p = torch.softmax(s, dim=-1)
    o = torch.matmul(p, v).transpose(1, 2)
    return o.reshape(o.shape[0], o.shape[1], -1)


def install_capture(model):
    fam = type(model).__module__  # transformers.models.<fam>.modeling_<fam>
    rope_fn = importlib.import_module(fam).apply_rotary_pos_emb
    handles = []
    for idx, layer in enumerate(model.model.layers):
        attn = layer.self_attn

        def pre(mod, args, kwargs, idx=idx):
            h = kwargs["hidden_states"] if "hidden_states" in kwargs else args[0]
            cos, sin = kwargs["position_embeddings"]
            b, t, _ = h.shape
            d = mod.head_dim
            q = mod.q_proj(h).view(b, t, -1, d).transpose(1, 2)
            k = mod.k_proj(h).view(b, t, -1, d).transpose(1, 2)
            v = mod.v_proj(h).view(b, t, -1, d).transpose(1, 2)
            q, k = rope_fn(q, k, cos, sin)
            CAPTURE[idx] = (q.detach().clone(), k.detach().clone(), v.detach().clone())

        def post(mod, args, kwargs, output, idx=idx):
            q, k, v = CAPTURE[idx]
            ref = mod.o_proj(_reference_attention(q, k, v, mod.scaling))
            out = output[0] if isinstance(output, tuple) else output
            CHECK["max_err"] = max(CHECK["max_err"], (ref - out).abs().max().item())
            CHECK["n"] = CHECK.get("n", 0) + 1

        handles.append(attn.register_forward_pre_hook(pre, with_kwargs=True))
        handles.append(attn.register_forward_hook(post, with_kwargs=True))
    return handles


def randomize(model, gen):
    """Non-trivial weights: ~N(0, 1/fan_in) matrices, N(0,1) embeddings,
    U(0.5,1.5) RMSNorm weights, N(0,0.5) biases."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight") or "layernorm" in name:
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
            elif name.endswith(".bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
            elif "embed_tokens" in name:
                p.copy_(torch.randn(p.shape, generator=gen))
            else:
                p.copy_(torch.randn(p.shape, generator=gen) / math.sqrt(p.shape[1]))


def tiny_configs():
    common = dict(hidden_act="silu", attention_dropout=0.0, bos_token_id=1, eos_token_id=2)
    return {
        "llama3": (LlamaForCausalLM, LlamaConfig(
            vocab_size=512, hidden_size=128, intermediate_size=320, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
            rope_parameters={"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                             "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 32},
            attention_bias=False, mlp_bias=False, **common)),
        "qwen2": (Qwen2ForCausalLM, Qwen2Config(
            vocab_size=384, hidden_size=64, intermediate_size=192, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
            rms_norm_eps=1e-6, tie_word_embeddings=True, use_sliding_window=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, **common)),
        "mistral": (MistralForCausalLM, MistralConfig(
            vocab_size=256, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=1, head_dim=32,
            max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=False,
            sliding_window=None,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, **common)),
        "smollm": (LlamaForCausalLM, LlamaConfig(
            vocab_size=320, hidden_size=96, intermediate_size=256, num_hidden_layers=3,
            num_attention_heads=6, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=512, rms_norm_eps=1e-5, tie_word_embeddings=True,
            rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
            attention_bias=False, mlp_bias=False, **common)),
    }


def tiny(out_dir, device):
    for seed, (name, (cls, cfg)) in enumerate(tiny_configs().items()):
        torch.manual_seed(1000 + seed)
        cfg._attn_implementation = "eager"
        model = cls(cfg)
        gen = torch.Generator().manual_seed(2000 + seed)
        randomize(model, gen)
        model = model.float().eval()
        if cfg.tie_word_embeddings:
            assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
        d = os.path.join(out_dir, name)
        os.makedirs(d, exist_ok=True)
        model.save_pretrained(d, safe_serialization=True)
        ids = torch.randint(3, cfg.vocab_size, (T_TINY,), generator=gen, dtype=torch.int64)
        model.to(device)
        install_capture(model)
        CAPTURE.clear()
        CHECK["max_err"] = 0.0
        CHECK["n"] = 0
        with torch.no_grad():
            logits = model(ids[None].to(device)).logits[0].float()
            # Cross-check against SDPA and a reload from disk.
            m2 = cls.from_pretrained(d, dtype=torch.float32, attn_implementation="sdpa").to(device)
            logits2 = m2(ids[None].to(device)).logits[0].float()
        sd_err = (logits - logits2).abs().max().item()
        nl = cfg.num_hidden_layers
        tensors = {
            "input_ids": ids.contiguous(),
            "logit_positions": torch.arange(T_TINY, dtype=torch.int64),
            "logits": logits.cpu().contiguous(),
        }
        for i in sorted({0, nl - 1}):
            q, k, v = CAPTURE[i]
            tensors[f"layer{i}.q"] = q[0].float().cpu().contiguous()
            tensors[f"layer{i}.k"] = k[0].float().cpu().contiguous()
            tensors[f"layer{i}.v"] = v[0].float().cpu().contiguous()
        save_file(tensors, os.path.join(d, "golden.safetensors"))
        rope = getattr(model.model.rotary_emb, "inv_freq", None)
        print(json.dumps({"config": name, "class": cls.__name__,
                          "params": sum(p.numel() for p in model.parameters()),
                          "capture_vs_reference_attention_max_err": CHECK["max_err"],
                          "attention_outputs_checked": CHECK["n"],
                          "eager_vs_sdpa_reload_logits_max_err": sd_err,
                          "logits_std": logits.std().item(),
                          "shapes": {k: list(v.shape) for k, v in tensors.items()},
                          "inv_freq": rope.tolist() if rope is not None else None}))
        assert CHECK["n"] == nl and CHECK["max_err"] < 1e-4 and sd_err < 1e-3, name
    print("transformers", transformers.__version__, "torch", torch.__version__)


def read_docs(path):
    import lzma
    opener = lzma.open if path.endswith(".xz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        return [d.strip("\n") for d in f.read().split("\x1e\n") if d.strip()]


def ref(model_dir, heldout, out_dir, device, input_text=None):
    import sentencepiece as spm
    sp = spm.SentencePieceProcessor(model_file=os.path.join(model_dir, "tokenizer.model"))
    model = LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    model = model.float().to(device).eval()  # bf16 weights upcast to fp32
    if input_text:
        doc = open(input_text, encoding="utf-8").read()
    else:
        docs = read_docs(heldout)
        doc = max(docs[:20], key=len)
    ids = [1] + sp.encode(doc)[:511]
    ids = torch.tensor(ids, dtype=torch.int64)
    T = ids.numel()
    pos = list(range(0, T, 8))
    if pos[-1] != T - 1:
        pos.append(T - 1)
    pos = torch.tensor(pos, dtype=torch.int64)
    with torch.no_grad():
        logits = model(ids[None].to(device)).logits[0].float().cpu()
    tensors = {"input_ids": ids, "logit_positions": pos, "logits": logits[pos].contiguous()}
    prompts = [
        "The PostgreSQL server",
        "def main():\n    ",
        "To configure the kernel, run",
    ]
    report = {}
    for j, p in enumerate(prompts):
        pids = torch.tensor([1] + sp.encode(p), dtype=torch.int64)
        cur = pids[None].to(device)
        out = []
        with torch.no_grad():
            for _ in range(32):  # plain greedy loop, full recompute, no cache, no eos stop
                nxt = model(cur).logits[0, -1].float().argmax().item()
                out.append(nxt)
                cur = torch.cat([cur, torch.tensor([[nxt]], device=device)], dim=1)
        tensors[f"prompt{j}_ids"] = pids.contiguous()
        tensors[f"prompt{j}_greedy"] = torch.tensor(out, dtype=torch.int64)
        report[f"prompt{j}"] = {"prompt": p, "continuation": sp.decode(out)}
    os.makedirs(out_dir, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()},
              os.path.join(out_dir, "golden.safetensors"))
    # Cross-check: HF generate (KV cache) must agree with the recompute loop.
    from transformers import GenerationConfig
    gc = GenerationConfig(max_new_tokens=32, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    for j in range(len(prompts)):
        pids = tensors[f"prompt{j}_ids"]
        with torch.no_grad():
            g = model.generate(pids[None].to(device), generation_config=gc)
        gen = g[0, pids.numel():].cpu().tolist()
        want = tensors[f"prompt{j}_greedy"].tolist()[:len(gen)]
        report[f"prompt{j}"]["generate_kv_cache_matches"] = f"{gen == want} ({len(gen)} tokens)"
    report["input_text_head"] = sp.decode(ids[1:60].tolist())
    report["shapes"] = {k: list(v.shape) for k, v in tensors.items()}
    print(json.dumps(report, indent=1))
    return report


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=["tiny", "ref"])
    ap.add_argument("--out", required=True)
    ap.add_argument("--model", default="models/ctxcache-ref")
    ap.add_argument("--heldout", default="training/work/corpus/heldout.txt")
    ap.add_argument("--input-text", default="",
                    help="text whose first 511 tokens (after <s>) form the 512-token input")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    a = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    if a.mode == "tiny":
        tiny(a.out, a.device)
    else:
        ref(a.model, a.heldout, a.out, a.device, a.input_text)


if __name__ == "__main__":
    main()
