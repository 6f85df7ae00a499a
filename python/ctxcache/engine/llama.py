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
P, 2P, ... plan). With lookahead (the decoder's ``lookahead`` and
``prefetching``) a third, the step before each plan's first use, plans the
next pages after attending; only step 0 then plans in line.
:class:`LlamaExtender` runs the same layers over a chunk of new tokens of
one sequence (chunked prefill of an extension).

On CUDA, for the bfloat16 models :func:`fusable` accepts (transformers'
Llama, Mistral and Qwen2), each run of a layer's elementwise ops is one Triton
kernel (residual add + RMSNorm, RoPE of q and k, silu(gate) * up): four
launches a layer instead of about thirty, in the dense baseline's step and
the sparse one alike. Elsewhere the step calls the model's own modules.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

import torch

__all__ = ["LlamaExtender", "LlamaStepper", "fusable"]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


def _module_rows(m: Any, x: torch.Tensor, position: torch.Tensor, attend: Any) -> torch.Tensor:
    """Every layer over R rows (x [R, hidden], position [R]) through the
    model's own modules: the rows' projections, RoPE and MLP; attention by
    ``attend(layer, q [R, Hq, d], k [R, H, d], v [R, H, d])``. ``m`` holds
    the model's modules (embed, layers, norm, rotary, hq, h, d). Returns the
    last hidden states after the final norm."""
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
    return m.norm(x)


def _fused_rows(m: Any, x: torch.Tensor, position: torch.Tensor, attend: Any) -> torch.Tensor:
    """_module_rows with each run of elementwise ops as one Triton kernel
    (``_triton.add_rmsnorm``, ``rope``, ``silu_mul``): a residual add and
    the norm after it, q's and k's RoPE, the MLP's silu(gate) * up. Four
    kernels a layer where the modules launch about thirty; the projections
    are the modules' own. Same results up to float32 summation order in the
    norm's mean."""
    from ctxcache.engine import _triton
    r = x.shape[0]
    cos, sin = m.rotary(x.unsqueeze(1), position.unsqueeze(1))
    cos, sin = cos.reshape(r, m.d).contiguous(), sin.reshape(r, m.d).contiguous()
    res = None                                # the residual not yet added to x
    for i, layer in enumerate(m.layers):
        a, mlp = layer.self_attn, layer.mlp
        norm = layer.input_layernorm
        x, hs = _triton.add_rmsnorm(x, res, norm.weight, norm.variance_epsilon)
        q, k = _triton.rope(a.q_proj(hs), a.k_proj(hs), cos, sin, m.hq, m.h, m.d)
        v = a.v_proj(hs).view(r, m.h, m.d)
        o = attend(i, q, k, v)
        norm = layer.post_attention_layernorm
        x, hs = _triton.add_rmsnorm(x, a.o_proj(o.reshape(r, m.hq * m.d)), norm.weight,
                                    norm.variance_epsilon)
        res = mlp.down_proj(_triton.silu_mul(mlp.gate_proj(hs), mlp.up_proj(hs)))
    return _triton.add_rmsnorm(x, res, m.norm.weight, m.norm.variance_epsilon)[1]


# The RMSNorm classes whose forward is LlamaRMSNorm's (float32 statistics,
# the normalized row rounded to the input's dtype, then times the weight).
_LLAMA_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm")


def fusable(model: Any) -> str:
    """Why the fused step (_fused_rows) cannot run ``model``, or "" when it
    can: a bfloat16 CUDA model with triton, Llama's RMSNorm in every norm,
    SiLU gated MLPs without biases, a power-of-two head dim."""
    return _why_not_fused(_Parts(model, fused=False), model)


def _why_not_fused(p: "_Parts", model: Any) -> str:
    try:
        import triton  # noqa: F401
    except ImportError:
        return "no triton"
    w = p.embed.weight
    if not w.is_cuda:
        return "not on a CUDA device"
    if w.dtype != torch.bfloat16:
        return f"dtype {w.dtype} is not bfloat16"
    if getattr(model.config, "hidden_act", None) not in ("silu", "swish"):
        return f"hidden_act {getattr(model.config, 'hidden_act', None)!r} is not silu"
    if p.d & (p.d - 1):
        return f"head_dim {p.d} is not a power of two"
    norms = [p.norm] + [n for lay in p.layers
                        for n in (lay.input_layernorm, lay.post_attention_layernorm)]
    for n in norms:
        if type(n).__name__ not in _LLAMA_NORMS or not hasattr(n, "variance_epsilon"):
            return f"norm {type(n).__name__} is not one of {_LLAMA_NORMS}"
        if n.weight.dtype != w.dtype:
            return f"norm weight dtype {n.weight.dtype} is not bfloat16"
    for lay in p.layers:
        mlp = lay.mlp
        if not all(isinstance(getattr(mlp, x, None), torch.nn.Linear) and
                   getattr(mlp, x).bias is None for x in ("gate_proj", "up_proj", "down_proj")):
            return "the MLP is not gate_proj/up_proj/down_proj without biases"
    return ""


class _Parts:
    """An HF Llama's modules and head shape, and the step over them: fused
    (_fused_rows) where ``fusable`` says it can run, else the modules'
    (_module_rows)."""

    def __init__(self, model: Any, fused: Optional[bool] = None) -> None:
        inner = model.model
        self.embed, self.layers, self.norm = inner.embed_tokens, inner.layers, inner.norm
        self.rotary, self.lm_head = inner.rotary_emb, model.lm_head
        cfg = model.config
        self.hq, self.h = cfg.num_attention_heads, cfg.num_key_value_heads
        self.d = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.hq
        self.fused = False
        if fused is not False:
            why = _why_not_fused(self, model)
            if why and fused:
                raise ValueError(f"fused: the model cannot run the fused step: {why}")
            self.fused = not why
        self.rows = _fused_rows if self.fused else _module_rows


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
            x = self.rows(self, self.embed(ids), pos, attention.attend)
        assert x is not None, "extend: no tokens"
        return self.lm_head(x[-1:]).float()[0]


class LlamaStepper(_Parts):
    """Greedy decode of B sequences: ``tokens`` [B] holds each sequence's
    last token and ``position`` [B] its position (the context's length for
    the first step); each step writes the next tokens into ``tokens``."""

    def __init__(self, model: Any, decoder: Any, batch: int, keep_logits: bool = False,
                 fused: Optional[bool] = None) -> None:
        """keep_logits: each step also writes its logits (float32 [B, vocab])
        into ``logits`` (Default: False). fused: the layer's elementwise ops
        as Triton kernels (_fused_rows); None uses them where ``fusable``
        allows, True raises ValueError where it does not (Default: None)."""
        super().__init__(model, fused)
        self.model, self.decoder, self.batch = model, decoder, batch
        dev = next(model.parameters()).device
        self.tokens = torch.zeros(batch, dtype=torch.int64, device=dev)
        self.position = torch.zeros(batch, dtype=torch.int64, device=dev)
        self.logits: Optional[torch.Tensor] = None
        if keep_logits:
            self.logits = torch.zeros(batch, model.config.vocab_size, dtype=torch.float32,
                                      device=dev)
        self.period = int(getattr(decoder, "period", 1))
        self.lookahead = self.period > 1 and bool(getattr(decoder, "lookahead", False))
        # Steps run since the last reset (see _mode_of).
        self.n_steps = 0
        # The next step plans in line whatever n_steps says (after a capture,
        # whose warm-up steps planned from their own queries).
        self.replan = False
        self.graphs: Dict[str, torch.cuda.CUDAGraph] = {}

    def reset(self) -> None:
        """The next step is step 0 again (a planning step)."""
        self.n_steps = 0
        self.replan = False

    def modes(self) -> list:
        """The kinds of step the decoder runs: "plan" (plans and resolves
        in line), "reuse" (attends the last plan's pages), "preplan" (reuses,
        then plans and resolves the next pages: lookahead)."""
        if self.period == 1:
            return ["plan"]
        return ["plan", "reuse"] + (["preplan"] if self.lookahead else [])

    def _mode_of(self) -> str:
        if self.period == 1 or self.replan or self.n_steps == 0:
            return "plan"
        r = self.n_steps % self.period
        if self.lookahead:
            return "preplan" if r == self.period - 1 else "reuse"
        return "plan" if r == 0 else "reuse"

    def _apply(self, mode: str) -> None:
        if self.period > 1:
            self.decoder.planning = mode == "plan"
            if self.lookahead:
                self.decoder.prefetching = mode == "preplan"

    def _advance(self, mode: str) -> None:
        self.n_steps += 1
        if mode == "plan":
            self.replan = False

    @torch.no_grad()
    def step(self) -> torch.Tensor:
        """One step, eagerly; returns ``tokens`` (now the next ones)."""
        mode = self._mode_of()
        self._apply(mode)
        self._step()
        self._advance(mode)
        return self.tokens

    def _step(self) -> None:
        dec = self.decoder
        dec.begin_step()
        x = self.rows(self, self.embed(self.tokens), self.position, dec.attend)
        logits = self.lm_head(x)
        if self.logits is not None:
            self.logits.copy_(logits)
        self.tokens.copy_(logits.argmax(dim=-1))
        self.position.add_(1)
        dec.end_step()

    def capture(self) -> None:
        """Records a step as a CUDA graph, one per mode (after one eager
        warm-up step of each, whose effects are undone by the caller
        resetting tokens, positions and the decoder's own tokens), and
        resets the step counter; the next step plans in line."""
        modes = self.modes()
        for mode in modes:
            self._apply(mode)
            self._step()
        torch.cuda.synchronize()
        for mode in modes:
            self._apply(mode)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                self._step()
            self.graphs[mode] = g
        self.reset()
        self.replan = True

    def replay(self) -> torch.Tensor:
        """One step by graph replay (the mode of the step counter)."""
        assert self.graphs, "capture() first"
        mode = self._mode_of()
        self._apply(mode)
        self.graphs[mode].replay()
        self._advance(mode)
        return self.tokens
