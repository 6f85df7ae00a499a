"""A thin adapter: greedy decode steps of an HF Llama-family model
(transformers' LlamaForCausalLM and its kin: q/k/v/o projections, RoPE,
RMSNorm, gated MLP) whose attention over a stored context goes through a
decoder of this package (:class:`ContextDecoder` or :class:`DenseDecoder`).

The step is written out layer by layer over the model's own modules, so that
it has static shapes and no host sync: :meth:`LlamaStepper.capture` records a
whole step (every layer, the argmax, the position advance) as one CUDA graph
and :meth:`replay` runs it. A decoder with a search period P > 1 (its
``period`` and ``planning`` attributes) gets two graphs, a planning step and
a step that reuses the plan; the stepper's step counter picks one (steps 0,
P, 2P, ... plan). :class:`LlamaExtender` runs the same layers over a chunk
of new tokens of one sequence (chunked prefill of an extension).
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch

__all__ = ["LlamaExtender", "LlamaStepper"]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _rows(m: Any, x: torch.Tensor, position: torch.Tensor, attend: Any) -> torch.Tensor:
    """Every layer over R rows (x [R, hidden], position [R]): the rows' own
    projections, RoPE and MLP; attention by ``attend(layer, q [R, Hq, d],
    k [R, H, d], v [R, H, d])``. ``m`` holds the model's modules (embed,
    layers, norm, rotary, hq, h, d). Returns the last hidden states."""
    r = x.shape[0]
    cos, sin = m.rotary(x.unsqueeze(1), position.unsqueeze(1))       # [R, 1, d]
    cos, sin = cos.view(r, 1, m.d), sin.view(r, 1, m.d)
    for i, layer in enumerate(m.layers):
        a = layer.self_attn
        hs = layer.input_layernorm(x)
        q = a.q_proj(hs).view(r, m.hq, m.d)
        k = a.k_proj(hs).view(r, m.h, m.d)
        v = a.v_proj(hs).view(r, m.h, m.d)
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        o = attend(i, q, k, v)
        x = x + a.o_proj(o.reshape(r, m.hq * m.d))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return x


class _Parts:
    """An HF Llama's modules and head shape."""

    def __init__(self, model: Any) -> None:
        inner = model.model
        self.embed, self.layers, self.norm = inner.embed_tokens, inner.layers, inner.norm
        self.rotary, self.lm_head = inner.rotary_emb, model.lm_head
        cfg = model.config
        self.hq, self.h = cfg.num_attention_heads, cfg.num_key_value_heads
        self.d = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.hq


class LlamaExtender(_Parts):
    """Chunked prefill of new tokens after a stored context (one sequence):
    each chunk runs every layer with attention by an extension attention of
    :mod:`ctxcache.engine.prefill` (which keeps the extension's K/V)."""

    @torch.no_grad()
    def __call__(self, attention: Any, tokens: torch.Tensor, position: int,
                 chunk: int = 1024) -> torch.Tensor:
        """tokens int64 [T] at positions position, position + 1, ...; returns the
        last token's logits (float32 [vocab])."""
        if chunk < 1:
            raise ValueError(f"chunk: expected >= 1, got {chunk}")
        x = None
        for c0 in range(0, tokens.shape[0], chunk):
            ids = tokens[c0:c0 + chunk]
            pos = torch.arange(position + c0, position + c0 + ids.shape[0],
                               device=tokens.device)
            x = _rows(self, self.embed(ids), pos, attention.attend)
        assert x is not None, "extend: no tokens"
        return self.lm_head(self.norm(x[-1:])).float()[0]


class LlamaStepper(_Parts):
    """Greedy decode of B sequences: ``tokens`` [B] holds each sequence's
    last token and ``position`` [B] its position (the context's length for
    the first step); each step writes the next tokens into ``tokens``."""

    def __init__(self, model: Any, decoder: Any, batch: int, keep_logits: bool = False) -> None:
        """keep_logits: each step also writes its logits (float32 [B, vocab])
        into ``logits`` (Default: False)."""
        super().__init__(model)
        self.model, self.decoder, self.batch = model, decoder, batch
        dev = next(model.parameters()).device
        self.tokens = torch.zeros(batch, dtype=torch.int64, device=dev)
        self.position = torch.zeros(batch, dtype=torch.int64, device=dev)
        self.logits: Optional[torch.Tensor] = None
        if keep_logits:
            self.logits = torch.zeros(batch, model.config.vocab_size, dtype=torch.float32,
                                      device=dev)
        self.period = int(getattr(decoder, "period", 1))
        # Steps run since the last reset (planning steps: n_steps % period == 0).
        self.n_steps = 0
        self.graphs: Dict[bool, torch.cuda.CUDAGraph] = {}

    def reset(self) -> None:
        """The next step is step 0 again (a planning step)."""
        self.n_steps = 0

    def _mode(self) -> None:
        if self.period > 1:
            self.decoder.planning = self.n_steps % self.period == 0

    @torch.no_grad()
    def step(self) -> torch.Tensor:
        """One step, eagerly; returns ``tokens`` (now the next ones)."""
        self._mode()
        self._step()
        self.n_steps += 1
        return self.tokens

    def _step(self) -> None:
        dec = self.decoder
        dec.begin_step()
        x = _rows(self, self.embed(self.tokens), self.position, dec.attend)
        logits = self.lm_head(self.norm(x))
        if self.logits is not None:
            self.logits.copy_(logits)
        self.tokens.copy_(logits.argmax(dim=-1))
        self.position.add_(1)
        dec.end_step()

    def capture(self) -> None:
        """Records a step as a CUDA graph, one per mode (after one eager
        warm-up step of each, whose effects are undone by the caller
        resetting tokens, positions and the decoder's own tokens), and
        resets the step counter."""
        modes = [True, False] if self.period > 1 else [True]
        self.reset()
        for plan in modes:
            self.n_steps = 0 if plan else 1
            self.step()
        torch.cuda.synchronize()
        for plan in modes:
            self.n_steps = 0 if plan else 1
            self._mode()
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                self._step()
            self.graphs[plan] = g
        self.reset()

    def replay(self) -> torch.Tensor:
        """One step by graph replay (the mode of the step counter)."""
        assert self.graphs, "capture() first"
        self.graphs[self.n_steps % self.period == 0].replay()
        self.n_steps += 1
        return self.tokens
