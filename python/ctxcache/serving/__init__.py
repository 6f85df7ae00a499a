"""Serving through a real engine with ctxcache as its prefix store.

The core (no transformers needed, tested on CPU against a real ctxcached):

* :class:`ServingOptions`: the fallback policy (``on_missing``) and the bounds
  of every wait;
* :class:`Resolver`: routes a request to the stored context that serves its
  prefix (named by id, or found by token-prefix match through the
  content-addressed id, :class:`PrefixIndex`) and loads its KV once into
  host memory (:class:`HostKVCache`);
* :func:`publish`: ingests a context with the label that makes it
  prefix-matchable.

The engine adapter, imported lazily: ``ctxcache.serving.transformers_cb``
(transformers' continuous batching: ``CtxcacheBackend``), and the launcher
``python -m ctxcache.serving.serve`` (``transformers serve`` with ctxcache).
docs/serving.md describes the design, the settings and the failure behaviour.
"""
from __future__ import annotations

from ctxcache.serving.kv import HostKV, HostKVCache
from ctxcache.serving.options import ON_MISSING_CHOICES, ServingOptions
from ctxcache.serving.prefix import TOKEN_KEY_LABEL, PrefixIndex, TokenStore, token_key
from ctxcache.serving.router import ModelShape, Resolution, Resolver, publish

__all__ = ["ServingOptions", "ON_MISSING_CHOICES", "Resolver", "Resolution", "ModelShape",
           "PrefixIndex", "TokenStore", "HostKV", "HostKVCache", "TOKEN_KEY_LABEL", "token_key",
           "publish"]
