"""A thin adapter: greedy decode steps of an HF Llama-family model
(transformers' LlamaForCausalLM and its kin: q/k/v/o projections, RoPE,
RMSNorm, gated MLP) whose attention over a stored context goes through a
decoder of this package (:class:`ContextDecoder` or :class:`DenseDecoder`).

The step is written out layer by layer over the model's own modules, so that
it has static shapes and no host sync: :meth:`LlamaStepper.capture` records a
whole step (every layer, the argmax, the position advance) as one CUDA graph
and :meth:`replay` runs it.
"""
from __future__ import annotations

from typing import Any, Optional

import torch

__all__ = ["LlamaStepper"]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class LlamaStepper:
    """Greedy decode of B sequences: ``tokens`` [B] holds each sequence's
    last token and ``position`` [B] its position (the context's length for
    the first step); each step writes the next tokens into ``tokens``."""

    def __init__(self, model: Any, decoder: Any, batch: int) -> None:
        self.model, self.decoder, self.batch = model, decoder, batch
        inner = model.model
        self.embed, self.layers, self.norm = inner.embed_tokens, inner.layers, inner.norm
        self.rotary, self.lm_head = inner.rotary_emb, model.lm_head
        cfg = model.config
        self.hq, self.h = cfg.num_attention_heads, cfg.num_key_value_heads
        self.d = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.hq
        dev = next(model.parameters()).device
        self.tokens = torch.zeros(batch, dtype=torch.int64, device=dev)
        self.position = torch.zeros(batch, dtype=torch.int64, device=dev)
        self.graph: Optional[torch.cuda.CUDAGraph] = None

    @torch.no_grad()
    def step(self) -> torch.Tensor:
        """One step, eagerly; returns ``tokens`` (now the next ones)."""
        b = self.batch
        dec = self.decoder
        dec.begin_step()
        x = self.embed(self.tokens)                                     # [B, hidden]
        cos, sin = self.rotary(x.unsqueeze(1), self.position.unsqueeze(1))  # [B, 1, d]
        cos, sin = cos.view(b, 1, self.d), sin.view(b, 1, self.d)
        for i, layer in enumerate(self.layers):
            a = layer.self_attn
            hs = layer.input_layernorm(x)
            q = a.q_proj(hs).view(b, self.hq, self.d)
            k = a.k_proj(hs).view(b, self.h, self.d)
            v = a.v_proj(hs).view(b, self.h, self.d)
            q = q * cos + _rotate_half(q) * sin
            k = k * cos + _rotate_half(k) * sin
            o = dec.attend(i, q, k, v)
            x = x + a.o_proj(o.reshape(b, self.hq * self.d))
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        logits = self.lm_head(self.norm(x))
        self.tokens.copy_(logits.argmax(dim=-1))
        self.position.add_(1)
        dec.end_step()
        return self.tokens

    def capture(self) -> None:
        """Records one step as a CUDA graph (after one eager warm-up step, whose
        effects are undone by the caller resetting tokens, positions and the
        decoder's own tokens)."""
        self.step()
        torch.cuda.synchronize()
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.step()

    def replay(self) -> torch.Tensor:
        assert self.graph is not None, "capture() first"
        self.graph.replay()
        return self.tokens
