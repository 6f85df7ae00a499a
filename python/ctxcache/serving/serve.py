"""``transformers serve`` with ctxcache as its prefix store: one command.

    python -m ctxcache.serving.serve --model models/ctxcache-ref \\
        --ctxcache 127.0.0.1:7700 --port 8000 [--on-missing prefill|error]

It builds the same OpenAI-compatible server as ``transformers serve
--continuous-batching --force-model MODEL`` (transformers 5.17: its model
manager, handlers and ``build_server``), with two changes:

* continuous batching runs through :class:`CtxcacheBackend`: a request whose
  prompt token ids start with a stored context skips that prefix's prefill;
* a request may name a stored context with the extra body field
  ``ctxcache_context_id`` (OpenAI clients: ``extra_body={"ctxcache_context_id":
  ID}``); its prompt is then the context's tokens followed by the request's.
  The field is removed before transformers validates the body.

``--context-file doc.txt`` stores a document as a context when the model
loads (tokenized like a prompt, built by ctxcached) and prints its id.

ctxcache errors become HTTP errors: InvalidArgument 400, NotFound 404,
FailedPrecondition 409, Unavailable 503, DeadlineExceeded 504 (only with
``--on-missing error``, or for requests no fallback can serve).
"""
from __future__ import annotations

import argparse
import asyncio
import contextvars
import sys
from typing import Any, Dict, List, Optional, Sequence

from ctxcache import errors
from ctxcache.serving.options import (ATTENTION_CHOICES, KV_TRANSPORT_CHOICES, ON_MISSING_CHOICES,
                                      ServingOptions)

__all__ = ["main", "build_app", "CONTEXT_FIELD"]

CONTEXT_FIELD = "ctxcache_context_id"
_HTTP_STATUS = {errors.InvalidArgument: 400, errors.NotFound: 404,
                errors.FailedPrecondition: 409, errors.Unavailable: 503,
                errors.DeadlineExceeded: 504}


def _status(e: errors.Error) -> int:
    for cls, code in _HTTP_STATUS.items():
        if isinstance(e, cls):
            return code
    return 500


def _handler_class(base: type, request_context: contextvars.ContextVar) -> type:
    """``base`` (a transformers serving handler) that takes the context id
    field out of the body and maps ctxcache errors to HTTP errors."""

    class Handler(base):  # type: ignore[misc, valid-type]
        async def handle_request(self, body: dict, request_id: str) -> Any:
            from fastapi import HTTPException
            cid = body.pop(CONTEXT_FIELD, None)
            if cid is not None and not isinstance(cid, str):
                raise HTTPException(status_code=400, detail=f"{CONTEXT_FIELD}: expected a "
                                                            "string of 32 hex characters")
            token = request_context.set(cid)
            try:
                return await super().handle_request(body, request_id)
            except errors.Error as e:
                raise HTTPException(status_code=_status(e), detail=str(e)) from None
            finally:
                request_context.reset(token)

    Handler.__name__ = "Ctxcache" + base.__name__
    return Handler


def _store_context_files(address: str, tokenizer_path: str, paths: Sequence[str],
                         client_kwargs: Optional[Dict[str, Any]]) -> List[tuple]:
    """Tokenizes each file with the served model's tokenizer (as a request's
    prompt is tokenized, BOS included) and builds it on ctxcached (idempotent:
    a stored context is found, not rebuilt). Returns ``[(ContextInfo, ids)]``."""
    from transformers import AutoTokenizer

    from ctxcache.client import Client
    tok = AutoTokenizer.from_pretrained(tokenizer_path)
    out = []
    with Client(address, timeout=3600, **(client_kwargs or {})) as c:
        for path in paths:
            with open(path, encoding="utf-8") as f:
                ids = list(tok(f.read())["input_ids"])
            info = c.build(tokens=ids, name=path, progress=False).context
            print(f"ctxcache: context {info.context_id}: {len(ids)} tokens of {path}",
                  file=sys.stderr, flush=True)
            out.append((info, ids))
    return out


def build_app(model: str, ctxcache_address: str, options: ServingOptions, *,
              fingerprints: Optional[Sequence[bytes]] = None,
              context_files: Sequence[str] = (), device: str = "auto",
              dtype: str = "auto", attn_implementation: Optional[str] = "paged|sdpa",
              cb_config: Optional[Dict[str, Any]] = None, enable_cors: bool = False,
              client_kwargs: Optional[Dict[str, Any]] = None) -> Any:
    """The FastAPI app of ``transformers serve`` with ctxcache (see the
    module's docstring). The model loads on the first request, as in
    transformers serve."""
    from transformers import ContinuousBatchingConfig
    from transformers.cli.serving.chat_completion import ChatCompletionHandler
    from transformers.cli.serving.completion import CompletionHandler
    from transformers.cli.serving.model_manager import ModelManager
    from transformers.cli.serving.response import ResponseHandler
    from transformers.cli.serving.server import build_server
    from transformers.cli.serving.transcription import TranscriptionHandler
    from transformers.cli.serving.utils import CBGenerateManager, GenerationState

    from ctxcache.serving.transformers_cb import CtxcacheBackend, REQUEST_CONTEXT_ID

    options.validate()

    class CtxcacheCBGenerateManager(CBGenerateManager):
        """transformers serve's CB manager, built by a CtxcacheBackend."""

        backend: Optional[CtxcacheBackend] = None

        def init_cb(self, model_: Any, gen_config: Any) -> None:
            if self._cb is not None:
                return
            fps = list(fingerprints or [])
            if not fps:
                from ctxcache.torch import hf
                fps.append(hf.model_spec(model_, "")["fingerprint"])
            stored = _store_context_files(ctxcache_address, model, context_files, client_kwargs)
            # Contexts ctxcached built carry its model's fingerprint: accepted
            # for the files given here (the same model, served by both).
            fps += [bytes(info.model.fingerprint) for info, _ in stored]
            self.backend = CtxcacheBackend(ctxcache_address, model_, fps, options,
                                           client_kwargs=client_kwargs)
            for info, ids in stored:
                self.backend.resolver.tokens.put(info, ids)
                self.backend.resolver.index.add(info)
            from transformers import AutoTokenizer
            bos = AutoTokenizer.from_pretrained(model).bos_token_id
            self.backend.named_drop_leading = bos  # the request's BOS, after the context's
            self._cb = self.backend.manager(gen_config, self._cb_config)
            self._cb.start()

        async def generate_non_streaming(self, model_: Any, processor: Any, inputs: dict,
                                         gen_config: Any, request_id: str) -> Any:
            # Load the context's KV off the event loop first, so that the
            # routing inside add_request finds it in host memory.
            if self.backend is not None:
                ids = list(inputs["input_ids"])
                await asyncio.to_thread(self.backend.prefetch, ids, REQUEST_CONTEXT_ID.get())
            return await super().generate_non_streaming(model_, processor, inputs, gen_config,
                                                        request_id)

        def stop(self) -> None:
            super().stop()
            if self.backend is not None:
                self.backend.close()

    class CtxcacheGenerationState(GenerationState):
        """Continuous batching always on, through ctxcache."""

        def get_manager(self, model_id: str, use_cb: bool = False) -> Any:
            if not use_cb:
                return super().get_manager(model_id, use_cb)
            if self._cb_model_id != model_id and self._cb_manager is not None:
                self._cb_manager.stop()
                self._cb_manager = None
            if self._cb_manager is None:
                self._cb_manager = CtxcacheCBGenerateManager(cb_config=self._cb_config)
                self._cb_model_id = model_id
            return self._cb_manager

    manager = ModelManager(device=device, dtype=dtype, attn_implementation=attn_implementation,
                           force_model=model)
    cfg = ContinuousBatchingConfig(**(cb_config or {}))
    state = CtxcacheGenerationState(continuous_batching=True, cb_config=cfg)
    chat = _handler_class(ChatCompletionHandler, REQUEST_CONTEXT_ID)(
        model_manager=manager, generation_state=state)
    completion = _handler_class(CompletionHandler, REQUEST_CONTEXT_ID)(
        model_manager=manager, generation_state=state)
    response = _handler_class(ResponseHandler, REQUEST_CONTEXT_ID)(
        model_manager=manager, generation_state=state)
    transcription = TranscriptionHandler(manager, state)
    return build_server(manager, chat, completion_handler=completion, response_handler=response,
                        transcription_handler=transcription, generation_state=state,
                        enable_cors=enable_cors)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m ctxcache.serving.serve",
        description="transformers serve (continuous batching) with ctxcache as its prefix store")
    ap.add_argument("--model", required=True, help="HF model folder or id (loaded on the first "
                                                   "request, as transformers serve does)")
    ap.add_argument("--ctxcache", required=True, metavar="HOST:PORT", help="ctxcached address")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--on-missing", choices=ON_MISSING_CHOICES, default="prefill",
                    help="a stored prefix that cannot be used: prefill it, or fail the request")
    ap.add_argument("--attention", choices=ATTENTION_CHOICES, default="dense",
                    help="attention over a stored prefix (docs/serving.md)")
    ap.add_argument("--sparse-rho", type=float, default=0.05,
                    help="sparse: prefix pages a decode step attends, fraction")
    ap.add_argument("--sparse-min-tokens", type=int, default=1024,
                    help="sparse: the budget's floor, tokens")
    ap.add_argument("--rpc-timeout", type=float, default=2.0, help="seconds per metadata RPC")
    ap.add_argument("--load-timeout", type=float, default=120.0, help="seconds per KV load")
    ap.add_argument("--host-cache-gib", type=float, default=8.0,
                    help="context KV kept in host memory, GiB")
    ap.add_argument("--kv-transport", choices=KV_TRANSPORT_CHOICES, default="auto",
                    help="how stored KV reaches this process: FetchKV frames, ctxcached's "
                         "shared memory on this host (MapKV), or auto (map on loopback)")
    ap.add_argument("--fingerprint", action="append", default=[], metavar="HEX",
                    help="model fingerprint whose stored KV this model may use (repeatable; "
                         "default: SHA-256 over the weights, as ctxcache.torch.hf.model_spec)")
    ap.add_argument("--context-file", action="append", default=[], metavar="PATH",
                    help="a text file stored as a context when the model loads (tokenized "
                         "like a prompt, built by ctxcached); its id is printed, requests may "
                         "name it or start with its text (repeatable)")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--attn-implementation", default="paged|sdpa",
                    help="the paged attention of transformers 5.17 (\"sdpa_paged\")")
    ap.add_argument("--cb-block-size", type=int)
    ap.add_argument("--cb-num-blocks", type=int)
    ap.add_argument("--cb-max-batch-tokens", type=int)
    ap.add_argument("--cb-max-memory-percent", type=float)
    ap.add_argument("--api-key-env", default="CTXCACHE_API_KEY",
                    help="environment variable holding ctxcached's API key (if any)")
    return ap


def missing_server_packages() -> List[str]:
    """The packages ``transformers serve`` imports that are not installed
    (transformers 5.17's serving module needs fastapi, uvicorn and openai)."""
    import importlib.util
    return [m for m in ("fastapi", "uvicorn", "openai") if importlib.util.find_spec(m) is None]


def main(argv: Optional[List[str]] = None) -> int:
    a = _parser().parse_args(argv)
    try:
        fps = [bytes.fromhex(f) for f in a.fingerprint] or None
    except ValueError:
        print(f"--fingerprint: {a.fingerprint!r}, expected hex strings", file=sys.stderr)
        return 2
    try:
        options = ServingOptions(on_missing=a.on_missing, rpc_timeout_s=a.rpc_timeout,
                                 load_timeout_s=a.load_timeout,
                                 host_cache_bytes=int(a.host_cache_gib * (1 << 30)),
                                 kv_transport=a.kv_transport,
                                 attention=a.attention, sparse_rho=a.sparse_rho,
                                 sparse_min_tokens=a.sparse_min_tokens).validate()
    except ValueError as e:
        print(str(e), file=sys.stderr)
        return 2
    cb = {k: v for k, v in {"block_size": a.cb_block_size, "num_blocks": a.cb_num_blocks,
                            "max_batch_tokens": a.cb_max_batch_tokens,
                            "max_memory_percent": a.cb_max_memory_percent}.items()
          if v is not None}
    missing = missing_server_packages()
    if missing:
        print(f"ctxcache.serving.serve: transformers serve needs the Python packages "
              f"{', '.join(missing)}, which are not installed (transformers' 'serving' "
              f"extra: fastapi, uvicorn, openai)", file=sys.stderr)
        return 2
    import os
    key = os.environ.get(a.api_key_env, "")
    app = build_app(a.model, a.ctxcache, options, fingerprints=fps,
                    context_files=a.context_file, device=a.device,
                    dtype=a.dtype, attn_implementation=a.attn_implementation, cb_config=cb,
                    client_kwargs={"api_key": key} if key else None)
    import uvicorn
    uvicorn.run(app, host=a.host, port=a.port, log_level="info")
    return 0


if __name__ == "__main__":
    sys.exit(main())
