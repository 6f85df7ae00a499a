"""The reference model's architecture in plain torch: a LLaMA (RMSNorm, RoPE,
SwiGLU, GQA, tied embeddings) whose parameter names and checkpoint layout are
those of HF transformers' LlamaForCausalLM, so a checkpoint saved here loads in
transformers and in the C++ prefill engine (model/), and vice versa.

Training (train.py) uses this module on the GPU machine (torch 2.x, SDPA flash
attention) and on the CPU machine (Debian's python3-torch 1.13, which has no
SDPA: attention is then computed with an explicit causal mask). transformers is
not needed; tests/train/llama_test.py checks this module against the HF golden
logits in tests/data/golden.

Checkpoints: config.json (the fields LlamaConfig writes, RoPE in
`rope_parameters`), safetensors shards of at most `max_shard_bytes` and
model.safetensors.index.json, written and read with the standard library
(safetensors is a JSON header plus raw little-endian tensors).
"""
import json
import math
import os
import struct

import torch
import torch.nn as nn
import torch.nn.functional as F

BOS, EOS = 1, 2
_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
           "I64": torch.int64}
_NAMES = {v: k for k, v in _DTYPES.items()}


class Config:
    """The LlamaConfig fields this architecture uses."""

    def __init__(self, vocab_size=8192, hidden_size=512, intermediate_size=1024,
                 num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=2,
                 head_dim=None, rope_theta=500000.0, rms_norm_eps=1e-5,
                 max_position_embeddings=32768, tie_word_embeddings=True):
        self.vocab_size = vocab_size
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_hidden_layers = num_hidden_layers
        self.num_attention_heads = num_attention_heads
        self.num_key_value_heads = num_key_value_heads
        self.head_dim = head_dim or hidden_size // num_attention_heads
        self.rope_theta = rope_theta
        self.rms_norm_eps = rms_norm_eps
        self.max_position_embeddings = max_position_embeddings
        self.tie_word_embeddings = tie_word_embeddings

    def to_hf(self):
        return {
            "architectures": ["LlamaForCausalLM"], "attention_bias": False,
            "attention_dropout": 0.0, "bos_token_id": BOS, "dtype": "bfloat16",
            "eos_token_id": EOS, "head_dim": self.head_dim, "hidden_act": "silu",
            "hidden_size": self.hidden_size, "initializer_range": 0.02,
            "intermediate_size": self.intermediate_size,
            "max_position_embeddings": self.max_position_embeddings, "mlp_bias": False,
            "model_type": "llama", "num_attention_heads": self.num_attention_heads,
            "num_hidden_layers": self.num_hidden_layers,
            "num_key_value_heads": self.num_key_value_heads, "pad_token_id": None,
            "pretraining_tp": 1, "rms_norm_eps": self.rms_norm_eps,
            "rope_parameters": {"rope_theta": self.rope_theta, "rope_type": "default"},
            "tie_word_embeddings": self.tie_word_embeddings, "use_cache": True,
            "vocab_size": self.vocab_size}

    @staticmethod
    def from_hf(c):
        rope = c.get("rope_parameters") or {}
        if rope.get("rope_type", "default") != "default" or c.get("rope_scaling"):
            raise ValueError("only default RoPE is supported")
        if c.get("attention_bias") or c.get("mlp_bias"):
            raise ValueError("biases are not supported")
        return Config(vocab_size=c["vocab_size"], hidden_size=c["hidden_size"],
                      intermediate_size=c["intermediate_size"],
                      num_hidden_layers=c["num_hidden_layers"],
                      num_attention_heads=c["num_attention_heads"],
                      num_key_value_heads=c.get("num_key_value_heads") or c["num_attention_heads"],
                      head_dim=c.get("head_dim"),
                      rope_theta=rope.get("rope_theta", c.get("rope_theta", 10000.0)),
                      rms_norm_eps=c.get("rms_norm_eps", 1e-6),
                      max_position_embeddings=c.get("max_position_embeddings", 32768),
                      tie_word_embeddings=c.get("tie_word_embeddings", False))


class RMSNorm(nn.Module):
    def __init__(self, n, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        dt = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dt)


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


ATTN_BLOCK = 1024  # query rows per block in the torch < 2.0 attention


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        hd = c.head_dim
        self.q_proj = nn.Linear(c.hidden_size, c.num_attention_heads * hd, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * hd, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.num_key_value_heads * hd, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * hd, c.hidden_size, bias=False)

    def qkv(self, x, cos, sin):
        """q, k, v [B, heads, T, head_dim] after RoPE, k and v repeated to
        the query heads (cos/sin: the rows of model.rope for x's positions)."""
        B, T, _ = x.shape
        c, hd = self.c, self.c.head_dim
        q = self.q_proj(x).view(B, T, c.num_attention_heads, hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, c.num_key_value_heads, hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, c.num_key_value_heads, hd).transpose(1, 2)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        g = c.num_attention_heads // c.num_key_value_heads
        return q, k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)

    def out(self, o):
        """o_proj of the attention output o [B, heads, T, head_dim]."""
        B, _, T, _ = o.shape
        return self.o_proj(o.transpose(1, 2).reshape(B, T, -1))

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        hd = self.c.head_dim
        q, k, v = self.qkv(x, cos, sin)
        if hasattr(F, "scaled_dot_product_attention"):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:  # torch < 2.0 (the CPU machine's Debian torch)
            # Blocks of queries against the keys up to the block's end: the
            # score matrix is [B, H, block, T] at most, not [B, H, T, T]
            # (8 heads at 16K would be 8.6 GB), and each row's softmax is
            # the same as unblocked.
            o = torch.empty_like(q)
            for i in range(0, T, ATTN_BLOCK):
                j = min(T, i + ATTN_BLOCK)
                s = torch.matmul(q[:, :, i:j], k[:, :, :j].transpose(-1, -2)) / math.sqrt(hd)
                mask = torch.ones(j - i, j, dtype=torch.bool, device=x.device).triu(i + 1)
                o[:, :, i:j] = torch.matmul(
                    torch.softmax(s.masked_fill(mask, float("-inf")).float(), -1).to(v.dtype),
                    v[:, :, :j])
        return self.out(o)


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.gate_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(c.hidden_size, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, c.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.self_attn = Attention(c)
        self.mlp = MLP(c)
        self.input_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(c.hidden_size, c.rms_norm_eps)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class Body(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.layers = nn.ModuleList([Layer(c) for _ in range(c.num_hidden_layers)])
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)


class Llama(nn.Module):
    """forward(ids [B, T] int64) -> logits [B, T, vocab]."""

    def __init__(self, c, seed=0):
        super().__init__()
        self.config = c
        torch.manual_seed(seed)
        self.model = Body(c)
        if not c.tie_word_embeddings:
            self.lm_head = nn.Linear(c.hidden_size, c.vocab_size, bias=False)
        for m in self.modules():  # HF LlamaPreTrainedModel._init_weights
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def rope(self, T, device):
        hd = self.config.head_dim
        inv = 1.0 / (self.config.rope_theta ** (torch.arange(0, hd, 2, device=device).float() / hd))
        f = torch.outer(torch.arange(T, device=device).float(), inv)
        emb = torch.cat((f, f), dim=-1)
        return emb.cos()[None, None], emb.sin()[None, None]

    def forward(self, ids):
        x = self.model.embed_tokens(ids)
        cos, sin = self.rope(ids.shape[1], ids.device)
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        x = self.model.norm(x)
        w = self.model.embed_tokens.weight if self.config.tie_word_embeddings else self.lm_head.weight
        return F.linear(x, w)

    @torch.no_grad()
    def greedy(self, ids, n_new):
        """Greedy continuation of ids (1-D list) by n_new tokens (full forward
        per token; contexts here are at most 32K tokens and answers short)."""
        dev = next(self.parameters()).device
        x = torch.as_tensor([ids], dtype=torch.int64, device=dev)
        out = []
        for _ in range(n_new):
            nxt = int(self(x)[0, -1].float().argmax())
            out.append(nxt)
            x = torch.cat([x, torch.tensor([[nxt]], device=dev)], dim=1)
        return out


@torch.no_grad()
def attention_inputs(model, ids):
    """(logits [B, T, vocab], [per layer: the input its self_attn gets, i.e.
    the normed hidden state [B, T, hidden]]): the model's own forward, with
    each attention input captured by a forward pre-hook, for tools that score
    q against k themselves (Attention.qkv on a captured input gives that
    layer's post-RoPE q, k and v)."""
    cap = {}
    hooks = [layer.self_attn.register_forward_pre_hook(
        lambda mod, args, li=li: cap.__setitem__(li, args[0]))
        for li, layer in enumerate(model.model.layers)]
    try:
        logits = model(ids)
    finally:
        for h in hooks:
            h.remove()
    return logits, [cap[li] for li in range(len(model.model.layers))]


@torch.no_grad()
def prefix_kv(model, ids):
    """Per layer, the context's k and v ([1, heads, n, head_dim], post-RoPE,
    repeated to the query heads) under full attention: the KV cache the
    server's prefill stores, for tail_logits."""
    dev = next(model.parameters()).device
    x = model.model.embed_tokens(torch.as_tensor(ids, dtype=torch.int64, device=dev)[None])
    cos, sin = model.rope(len(ids), dev)
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    cache = []
    for layer in model.model.layers:
        _, k, v = layer.self_attn.qkv(layer.input_layernorm(x), cos, sin)
        cache.append((k, v))
        x = layer(x, cos, sin)
    return cache


@torch.no_grad()
def tail_logits(model, cache, tail, rho=None, extend=False):
    """Logits [len(tail), vocab] (fp32) of tail (token ids placed after the
    context of `cache`, from prefix_kv). Each tail row attends to the tail up
    to itself and to the context: all of it, or with rho, per query head and
    layer only the top ceil(rho * n) context keys by q.k plus key 0 (the
    oracle selection of DESIGN 5.5, exact top-K per q head, in torch: the
    training machine's proxy for a 1 - rho sparse decode of the context).
    extend=True also returns the cache with the tail's k and v appended (a
    decode step: the next tail starts after this one)."""
    dev = next(model.parameters()).device
    n = cache[0][0].shape[2]
    x = model.model.embed_tokens(torch.as_tensor(tail, dtype=torch.int64, device=dev)[None])
    m = len(tail)
    cos, sin = model.rope(n + m, dev)
    cos, sin = cos[:, :, n:].to(x.dtype), sin[:, :, n:].to(x.dtype)
    K = max(1, math.ceil(rho * n)) if rho is not None else n
    hd = model.config.head_dim
    causal = torch.ones(m, m, dtype=torch.bool, device=dev).triu(1)
    grown = []
    for layer, (kc, vc) in zip(model.model.layers, cache):
        at = layer.self_attn
        q, kt, vt = at.qkv(layer.input_layernorm(x), cos, sin)
        if extend:
            grown.append((torch.cat([kc, kt], 2), torch.cat([vc, vt], 2)))
        sc = torch.matmul(q, kc.transpose(-1, -2)).float() / math.sqrt(hd)
        if K < n:
            keep = torch.zeros_like(sc, dtype=torch.bool)
            keep.scatter_(-1, sc.topk(K, dim=-1).indices, True)
            keep[..., 0] = True
            sc = sc.masked_fill(~keep, float("-inf"))
        st = (torch.matmul(q, kt.transpose(-1, -2)).float() / math.sqrt(hd)).masked_fill(
            causal, float("-inf"))
        p = torch.softmax(torch.cat([sc, st], -1), -1).to(vc.dtype)
        x = x + at.out(torch.matmul(p, torch.cat([vc, vt], 2)))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    w = (model.model.embed_tokens.weight if model.config.tie_word_embeddings
         else model.lm_head.weight)
    logits = F.linear(model.model.norm(x), w)[0].float()
    return (logits, grown) if extend else logits


# ----------------------------------------------------------- checkpoints ----

def _write_safetensors(path, tensors):
    header, blobs, off = {}, [], 0
    for name, t in tensors.items():
        t = t.detach().contiguous().cpu()
        b = t.view(torch.uint8).numpy().tobytes() if t.dtype == torch.bfloat16 else t.numpy().tobytes()
        header[name] = {"dtype": _NAMES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * ((8 - len(h) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for b in blobs:
            f.write(b)


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        a, b = meta["data_offsets"]
        dt = _DTYPES[meta["dtype"]]
        buf = bytearray(data[a:b])
        t = torch.frombuffer(buf, dtype=torch.uint8) if b > a else torch.empty(0, dtype=torch.uint8)
        out[name] = t.view(dt).reshape(meta["shape"]).clone()
    return out


def save_pretrained(model, out_dir, dtype=torch.bfloat16, max_shard_bytes=15_000_000):
    """config.json + shards of at most max_shard_bytes + the index, in the
    order of the state dict (tied lm_head is not saved, as in HF)."""
    os.makedirs(out_dir, exist_ok=True)
    sd = {k: v.to(dtype) for k, v in model.state_dict().items()}
    shards, cur, cur_bytes = [], {}, 0
    for k, v in sd.items():
        nb = v.numel() * v.element_size()
        if cur and cur_bytes + nb > max_shard_bytes:
            shards.append(cur)
            cur, cur_bytes = {}, 0
        cur[k] = v
        cur_bytes += nb
    shards.append(cur)
    for f in os.listdir(out_dir):
        if f.endswith(".safetensors") or f == "model.safetensors.index.json":
            os.remove(os.path.join(out_dir, f))
    weight_map = {}
    for i, s in enumerate(shards):
        fn = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        _write_safetensors(os.path.join(out_dir, fn), s)
        for k in s:
            weight_map[k] = fn
    total = sum(v.numel() * v.element_size() for v in sd.values())
    with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    cfg = model.config.to_hf()
    cfg["dtype"] = {torch.bfloat16: "bfloat16", torch.float32: "float32"}[dtype]
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)


def from_pretrained(model_dir, dtype=torch.float32, device="cpu"):
    with open(os.path.join(model_dir, "config.json")) as f:
        c = Config.from_hf(json.load(f))
    idx = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(idx):
        with open(idx) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    sd = {}
    for fn in files:
        sd.update(read_safetensors(os.path.join(model_dir, fn)))
    m = Llama(c)
    missing, unexpected = m.load_state_dict(sd, strict=False)
    if unexpected or [k for k in missing if k != "lm_head.weight"]:
        raise ValueError(f"{model_dir}: missing {missing}, unexpected {unexpected}")
    return m.to(device=device, dtype=dtype).eval()
