#!/usr/bin/env python3
"""training/llama.py (the training model) against HF transformers' golden
logits, and its checkpoint format.

  python3 tests/train/llama_test.py REPO_ROOT
Exit 77 (ctest skip) without torch (Debian: python3-torch).
"""
import os
import sys
import tempfile
import unittest

ROOT = os.path.abspath(sys.argv.pop(1) if len(sys.argv) > 1 else
                       os.path.join(os.path.dirname(__file__), "..", ".."))
try:
    import torch
except ImportError:
    print("torch is not installed; skipped")
    sys.exit(77)
sys.path.insert(0, os.path.join(ROOT, "training"))
import llama  # noqa: E402

GOLDEN = os.path.join(ROOT, "tests", "data", "golden")
REF = os.path.join(ROOT, "models", "ctxcache-ref")


def golden_logits(model, golden_file):
    g = llama.read_safetensors(golden_file)
    with torch.no_grad():
        got = model(g["input_ids"][None])[0][g["logit_positions"]]
    return got, g["logits"]


class LlamaTest(unittest.TestCase):
    def test_matches_hf_on_the_tiny_llama_golden(self):
        # smollm: LlamaForCausalLM, GQA 6:2, tied embeddings, default RoPE.
        m = llama.from_pretrained(os.path.join(GOLDEN, "smollm"))
        got, want = golden_logits(m, os.path.join(GOLDEN, "smollm", "golden.safetensors"))
        self.assertLess(float((got - want).abs().max()), 1e-3)

    @unittest.skipUnless(os.path.exists(os.path.join(REF, "model-00001-of-00004.safetensors")),
                         "reference weights not unpacked (scripts/unpack-models.sh)")
    def test_matches_hf_on_the_reference_model_golden(self):
        m = llama.from_pretrained(REF)
        got, want = golden_logits(m, os.path.join(GOLDEN, "ctxcache-ref", "golden.safetensors"))
        self.assertLess(float((got - want).abs().max()), 1e-3)

    def test_blocked_attention_equals_one_block(self):
        # torch < 2.0 computes attention in blocks of ATTN_BLOCK query rows;
        # block edges (a partial last block too) must not change the result.
        c = llama.Config(vocab_size=8192, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        m = llama.Llama(c, seed=3).eval()
        x = torch.randint(3, 8192, (2, 300), generator=torch.Generator().manual_seed(1))
        keep = llama.ATTN_BLOCK
        try:
            llama.ATTN_BLOCK = 1 << 20
            with torch.no_grad():
                whole = m(x)
            llama.ATTN_BLOCK = 64
            with torch.no_grad():
                blocked = m(x)
        finally:
            llama.ATTN_BLOCK = keep
        self.assertTrue(torch.allclose(whole, blocked, atol=1e-5, rtol=0))

    def test_save_then_load_keeps_the_bf16_weights_and_the_layout(self):
        c = llama.Config(vocab_size=320, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
        m = llama.Llama(c, seed=3).eval()
        x = torch.randint(3, 320, (1, 40), generator=torch.Generator().manual_seed(0))
        with tempfile.TemporaryDirectory() as d:
            llama.save_pretrained(m, d, dtype=torch.bfloat16, max_shard_bytes=40_000)
            files = sorted(f for f in os.listdir(d) if f.endswith(".safetensors"))
            self.assertGreater(len(files), 1)
            for f in files:
                self.assertLessEqual(os.path.getsize(os.path.join(d, f)), 40_000 + 4096)
            back = llama.from_pretrained(d)
            ref = llama.Llama(c, seed=3).eval()
            ref.load_state_dict({k: v.to(torch.bfloat16).float()
                                 for k, v in m.state_dict().items()})
            with torch.no_grad():
                self.assertTrue(torch.equal(back(x), ref(x)))
            self.assertNotIn("lm_head.weight", llama.read_safetensors(os.path.join(d, files[-1])))


if __name__ == "__main__":
    unittest.main(verbosity=1)
