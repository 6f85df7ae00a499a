"""ctxcache's GPU decode engine: batched sparse decode over stored contexts.

Seams (each its own module; a model adapter composes them):
  page store   :mod:`ctxcache.engine.pool`: HostTier (a context's pages in
               pinned host memory, bulk-loaded through the native client,
               or filled on demand with the pages steps plan, then
               bulk-loaded), PagePool (HBM slots; misses resolved on the
               device);
               :mod:`ctxcache.engine.mapped`: MappedKV (a context in the
               server's shared memory on the same host, registered with
               CUDA layer by layer)
  planner      :mod:`ctxcache.engine.planner`: QuestPlanner (the pages each
               sequence's kv head attends, from a compact index: the
               tier's keys' page bounds, or the stored Quest index, which
               can load in the background layer by layer)
  attention    :mod:`ctxcache.engine.attention`: PagedAttention (in place
               over pool pages plus own tokens), DenseContextAttention
  decode       :mod:`ctxcache.engine.engine`: ContextDecoder and DenseDecoder
               (one context, B sequences, their own tokens), BatchDecoder
               (a batch over several contexts)
  prefill      :mod:`ctxcache.engine.prefill`: SparseExtendAttention (chunked
               prefill of an extension with block-union page tables over
               the same compact index), DenseExtendAttention
  adapter      :mod:`ctxcache.engine.llama`: LlamaStepper (an HF Llama's
               decode step, capturable as one CUDA graph), LlamaExtender
               (its chunked prefill of an extension)
  write-back   :mod:`ctxcache.engine.writeback`: WriteBack (a sequence's
               appended tokens, from the extension's K/V and its own
               tokens, copied off the device on a side stream and stored
               as child contexts of the stored one, in the background)
No process-global state; the Triton kernels (CUDA) are in ``_triton`` and
every one has a torch reference used on the CPU.
"""
from ctxcache.engine.attention import DenseContextAttention, PagedAttention
from ctxcache.engine.engine import (BatchDecoder, ContextDecoder, DenseDecoder, EngineOptions,
                                   OwnTokens)
from ctxcache.engine.llama import LlamaExtender, LlamaStepper
from ctxcache.engine.mapped import MappedKV
from ctxcache.engine.planner import QuestPlanner, chunk_pages, quest_bounds
from ctxcache.engine.pool import HostTier, PagePool, PoolOptions
from ctxcache.engine.prefill import DenseExtendAttention, ExtendOptions, SparseExtendAttention
from ctxcache.engine.writeback import WriteBack, WriteBackOptions

__all__ = ["BatchDecoder", "ContextDecoder", "DenseContextAttention", "DenseDecoder",
           "DenseExtendAttention", "EngineOptions", "ExtendOptions", "HostTier",
           "LlamaExtender", "LlamaStepper", "MappedKV", "OwnTokens", "PagePool",
           "PagedAttention", "PoolOptions", "QuestPlanner", "SparseExtendAttention", "WriteBack",
           "WriteBackOptions", "chunk_pages", "quest_bounds"]
