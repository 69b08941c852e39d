"""The torch engine's paged model on the CPU (with torch; ``make test``
runs it in the vLLM venv, and skips it where torch is missing): a prompt
computed in chunks and decoded in padded batches over blocks of the pool
gives the tokens of plain causal attention over the whole sequence, and
the same tokens whatever else is in the batch and whether the prompt's
first blocks came from the prefix cache."""

import math
import os
import sys
import unittest

try:
    import torch
except ImportError:  # plain python3 (gms/tests/python.rs): nothing to run here
    torch = None

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

LAYERS, HIDDEN = 2, 256


@unittest.skipIf(torch is None, "needs torch")
class PagedModelTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        import batching
        import engine
        cls.b, cls.engine = batching, engine
        torch.manual_seed(0)
        m = engine.Model(LAYERS, HIDDEN, "cpu")
        with torch.no_grad():
            for name, p in m.named_parameters():
                if "norm" in name:
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]))
        cls.model = m
        cls.geo = batching.Geometry(LAYERS, HIDDEN, 64 * LAYERS * 2 * batching.BLOCK * HIDDEN * 2)
        cls.flat = torch.zeros(cls.geo.pool_bytes // 2, dtype=torch.bfloat16)
        cls.caches = cls.geo.caches(cls.flat)

    def prefill(self, prompt, blocks, start=0):
        b = self.b
        out = None
        for s in range(start, len(prompt), b.CHUNK):
            e = min(s + b.CHUNK, len(prompt))
            rows = [(prompt[j], j, blocks[j // b.BLOCK], j % b.BLOCK, blocks) for j in range(s, e)]
            flat = b._launch_rows(rows, b.CHUNK)
            for r in range(e - s, b.CHUNK):
                flat[r * b._ROW + 1] = s + r
            t = torch.tensor(flat).view(b.CHUNK, b._ROW)
            res = self.model.rows(t[:, 0], self.caches, t[:, 2], t[:, 3], t[:1, 4:], t[:, 1],
                                  torch.arange(b.MAX_CTX), (1, b.CHUNK))
            out = int(res[e - s - 1])
        return out

    def decode(self, seqs):
        b = self.b
        rows = [(s["out"][-1], s["kv"], s["blocks"][s["kv"] // b.BLOCK], s["kv"] % b.BLOCK, s["blocks"])
                for s in seqs]
        t = torch.tensor(b._launch_rows(rows, b.BATCH)).view(b.BATCH, b._ROW)
        res = self.model.rows(t[:, 0], self.caches, t[:, 2], t[:, 3], t[:, 4:4 + b.GRAPH_CTX // b.BLOCK], t[:, 1],
                              torch.arange(b.GRAPH_CTX), (b.BATCH, 1))
        for s, v in zip(seqs, res.tolist()):
            s["kv"] += 1
            s["out"].append(v)

    def generate(self, prompt, blocks, n, start=0, others=()):
        seq = {"blocks": blocks, "kv": len(prompt), "out": [self.prefill(prompt, blocks, start)]}
        for _ in range(n - 1):
            self.decode(list(others) + [seq])
        return seq["out"]

    def dense(self, prompt, n):
        """Plain causal attention over the whole sequence, recomputed for
        every token."""
        F = torch.nn.functional
        m, toks, out = self.model, list(prompt), []
        for _ in range(n):
            x = m.embed[torch.tensor(toks)]
            t, heads = len(toks), HIDDEN // self.engine.HEAD_DIM
            for layer in m.layers:
                q, k, v = F.linear(F.rms_norm(x, (HIDDEN,), layer.norm1), layer.qkv).split(HIDDEN, -1)
                q, k, v = (z.view(t, heads, -1).transpose(0, 1) for z in (q, k, v))
                a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                x = x + F.linear(a.transpose(0, 1).reshape(t, HIDDEN), layer.out)
                x = x + F.linear(F.silu(F.linear(F.rms_norm(x, (HIDDEN,), layer.norm2), layer.up)), layer.down)
            nxt = int(F.linear(F.rms_norm(x[-1:], (HIDDEN,), m.norm), m.embed).argmax(-1))
            out.append(nxt)
            toks.append(nxt)
        return out

    def test_paged_tokens_are_plain_attentions(self):
        prompt = [ord(c) for c in "a stream that outlives its engine, and more"]
        with torch.no_grad():
            self.assertEqual(self.generate(prompt, list(range(2, 7)), 20), self.dense(prompt, 20))

    def test_the_same_tokens_alone_batched_and_from_the_prefix_cache(self):
        prompt = [ord(c) for c in "a prompt of three blocks, more or less"]
        other = [ord(c) for c in "something else entirely, a longer prompt here"]
        with torch.no_grad():
            alone = self.generate(prompt, list(range(10, 15)), 24)
            other_seq = {"blocks": list(range(20, 25)), "kv": len(other), "out": [self.prefill(other, list(range(20, 25)))]}
            batched = self.generate(prompt, list(range(30, 35)), 24, others=[other_seq])
            # The first two blocks (full, before the last prompt token) are
            # the cold run's own: only the third is computed.
            hit = self.generate(prompt, [10, 11] + list(range(40, 43)), 24, start=2 * self.b.BLOCK)
        self.assertEqual(batched, alone)
        self.assertEqual(hit, alone)


if __name__ == "__main__":
    unittest.main()
