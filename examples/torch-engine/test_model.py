"""The torch engine's paged model and batch loop on the CPU (with torch;
``make test`` runs it in the vLLM venv, and skips it where torch is
missing): a prompt computed in chunks and decoded in padded batches over
blocks of the pool gives the tokens of plain causal attention over the
whole sequence, and the same tokens whatever else is in the batch and
whether the prompt's first blocks came from the prefix cache; and the
batch loop's steps carry streams across an engine's death through the
pool and its index. What needs the GPU (the CUDA graphs, the pool's
grant, the fence) is `make test-gpu`'s."""

import math
import os
import sys
import time
import unittest

try:
    import torch
except ImportError:  # plain python3 (gms/tests/python.rs): nothing to run here
    torch = None

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

LAYERS, HIDDEN = 2, 256


def random_model(engine, seed):
    """engine.Model on the CPU with random weights, as the engine makes
    them from its seed on the GPU (norms at one)."""
    torch.manual_seed(seed)
    m = engine.Model(LAYERS, HIDDEN, "cpu")
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]))
    return m


@unittest.skipIf(torch is None, "needs torch")
class PagedModelTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        import batching
        import engine
        cls.b, cls.engine = batching, engine
        cls.model = random_model(engine, seed=0)
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

    def test_a_step_of_several_launches_gives_each_its_own_tokens(self):
        # The launcher puts every launch's rows in one buffer and gathers
        # every result in another: each launch still gets its own tokens,
        # also when the step outgrows the buffers.
        b = self.b
        launcher = b.Launcher(self.model, device="cpu", graphs=False)
        launcher.capture(self.caches, 0)
        launcher._grow(4)
        prompt = [ord(c) for c in "one chunk of a prompt"][:b.CHUNK]
        chunk = b._launch_rows([(t, j, 50, j, [50, 51]) for j, t in enumerate(prompt)], b.CHUNK)
        for r in range(len(prompt), b.CHUNK):
            chunk[r * b._ROW + 1] = r
        batch = b._launch_rows([(7, 3, 52, 3, [52]), (9, 0, 53, 0, [53])], b.BATCH)
        alone = []
        with torch.no_grad():
            for shape, flat in ((b.PREFILL, chunk), (b.DECODE, batch)):
                t = torch.tensor(flat).view(shape.rows, b._ROW)
                alone.append(b.run_shape(self.model, self.caches, t, shape, launcher.positions).tolist())
            together = launcher.run([(b.PREFILL, chunk), (b.DECODE, batch)], times := {})
        self.assertEqual(together, alone)
        self.assertGreaterEqual(launcher.cap, b.CHUNK + b.BATCH)
        self.assertEqual(set(times), {"launch_ms", "sync_ms"})

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


@unittest.skipIf(torch is None, "needs torch")
class BatchLoopTest(unittest.TestCase):
    """The batch loop's steps (batching.Batcher, without its thread) on the
    CPU, over a pool and an index that outlive the engine: engine A serves
    three streams and dies mid-way (its last writes past what it committed
    left in the pool); engine B, on the same pool, takes them up from what
    the streams' state says, before the fence, and every stream ends with
    the tokens of an undisturbed run, with nothing computed again."""

    PROMPTS = ["a stream that outlives its engine, and more", "a stream that outlives its engine, and less",
               "another prompt entirely, not sharing blocks with the first two"]
    TOKENS = 40

    @classmethod
    def setUpClass(cls):
        import batching
        import continuity
        import engine
        import jobs
        import paged
        cls.b, cls.continuity, cls.engine, cls.jobs, cls.paged = batching, continuity, engine, jobs, paged
        cls.model = random_model(engine, seed=1)

    def setUp(self):
        self.fds = []

    def tearDown(self):
        for fd in self.fds:
            os.close(fd)

    def pool(self, blocks=96, pool_id=7):
        geo = self.b.Geometry(LAYERS, HIDDEN, blocks * LAYERS * 2 * self.b.BLOCK * HIDDEN * 2)
        fd = os.memfd_create("test-index", os.MFD_CLOEXEC)
        os.ftruncate(fd, self.paged.index_bytes(geo.blocks))
        self.fds.append(fd)
        return {"geo": geo, "flat": torch.zeros(geo.pool_bytes // 2, dtype=torch.bfloat16), "index": fd,
                "id": pool_id}

    def engine_on(self, pool, created, fenced):
        """A Batcher over ``pool``, as its grant leaves it (no thread)."""
        b = object.__new__(self.b.Batcher)
        self.jobs.Worker.__init__(b, "test-batch-loop")
        b.engine_id, b.gms, b.model, b.log = "t", None, self.model, (lambda **kw: self.events.append(kw))
        b.geo, b.nbytes = pool["geo"], pool["geo"].pool_bytes
        # Every shape eager on the CPU: the graphs' shapes, so their tokens.
        b.launch = self.b.Launcher(self.model, device="cpu", graphs=False)
        b.pool, b.pool_id, b.flat = None, pool["id"], pool["flat"]
        b.caches = b.geo.caches(b.flat)
        b.launch.capture(b.caches, 0)
        b.first_steps = None
        b.waiting, b.running, b.pins = [], [], {}
        b.figures = {"carried": 0, "from_pool": 0, "computed_again": 0, "copied": 0}
        b.blocks = self.paged.Blocks(self.paged.Index(pool["index"], b.geo.blocks, b.geo.block_bytes, pool["id"]))
        b.blocks.start(created, fenced)
        return b

    def streams(self):
        out = []
        for i, text in enumerate(self.PROMPTS):
            st = self.continuity.State.create(f"s{i}")
            self.fds.append(st.fd)
            out.append((f"c-test-{i}", st, self.engine.tokenize(text, self.TOKENS)))
        return out

    def submit(self, b, name, prompt, state, carried=None):
        progress = self.continuity.KvProgress(state.fd, carried, name)
        job = b.submit(prompt, self.TOKENS, progress)
        b._message(b.inbox.get_nowait())
        progress.close()
        return job

    def drain(self, job):
        out = []
        while True:
            try:
                t = job.q.get_nowait()
            except Exception:  # noqa: BLE001 (queue.Empty: nothing more yet)
                return out
            if t is self.jobs.END:
                out.append(t)
                return out
            out.append(t)

    def run_to_end(self, b, jobs, got, steps=500):
        with torch.no_grad():
            for _ in range(steps):
                if not (b.waiting or b.running):
                    break
                b._step()
        for name, job in jobs.items():
            got[name] += [t for t in self.drain(job) if t is not self.jobs.END]

    def test_streams_go_on_from_the_pool_after_their_engine_dies(self):
        self.events = []
        # Undisturbed, on a pool of its own.
        ref = self.engine_on(self.pool(), created=True, fenced=True)
        ref_streams = self.streams()
        ref_jobs = {name: self.submit(ref, name, prompt, st) for name, st, prompt in ref_streams}
        want = {name: [] for name in ref_jobs}
        self.run_to_end(ref, ref_jobs, want)
        self.assertTrue(all(len(t) == self.TOKENS for t in want.values()), want)

        # Engine A serves the same streams and dies 12 steps in; it takes
        # the pool's last blocks first.
        pool = self.pool()
        a = self.engine_on(pool, created=True, fenced=True)
        a.blocks.free.reverse()
        streams = self.streams()
        a_jobs = {name: self.submit(a, name, prompt, st) for name, st, prompt in streams}
        with torch.no_grad():
            for _ in range(12):
                a._step()
        sent = {name: [t for t in self.drain(job) if t is not self.jobs.END] for name, job in a_jobs.items()}
        self.assertTrue(all(0 < len(t) < self.TOKENS for t in sent.values()), "killed mid-stream")
        # What it wrote for steps it never committed: past each stream's
        # committed positions, in its tail block.
        for seq in a.running:
            tail = seq.blocks[seq.kv_len // self.b.BLOCK]
            view = a.geo.block_view(pool["flat"], tail).view(LAYERS, 2, self.b.BLOCK, HIDDEN)
            view[:, :, seq.kv_len % self.b.BLOCK:].normal_(0.0, 5.0)

        # Engine B on the same pool, before the fence: pins what each
        # stream's state names, then takes the streams up.
        b = self.engine_on(pool, created=False, fenced=False)
        # Its first steps are timed, as after a grant.
        b.first_steps, b.t_grant, b.how = [], time.perf_counter(), "adopted"
        carried = {name: self.continuity.read_kv(st.fd) for name, st, _ in streams}
        for name, kv in carried.items():
            b._message(("pin", name, kv))
            self.assertTrue(b.pins[name], f"{name}: its blocks are readable")
        b._message(("carried_done",))
        # Only the pool's first half is mapped yet (libgms maps the rest
        # after the grant): room enough, but the streams' blocks lie past
        # it, so they wait.
        half = b.geo.blocks // 2
        self.assertTrue(all(min(filter(None, kv["blocks"])) >= half for kv in carried.values()), carried)
        b.blocks.set_mapped(half)
        b_jobs = {name: self.submit(b, name, prompt, st, carried[name]) for name, st, prompt in streams}
        # A new request with the first stream's prompt: its prefix is in
        # the pool (records not read yet), past the mapped part.
        first_name, _, first_prompt = streams[0]
        again = b.submit(first_prompt, self.TOKENS)
        b._message(b.inbox.get_nowait())
        with torch.no_grad():
            for _ in range(3):
                b._step()
        self.assertEqual((len(b.waiting), b.running), (4, []),
                         "carried streams wait for their blocks, a new request for its cached prefix")
        self.assertTrue(all(not self.drain(job) for job in b_jobs.values()))
        b.blocks.set_mapped(b.geo.blocks)
        got = {name: list(carried[name]["tokens"]) for name in b_jobs}
        b_jobs["again"], got["again"] = again, []
        self.run_to_end(b, b_jobs, got)
        self.assertEqual(again.cached, 32, "its prompt's two full blocks from the dead engine's cache")
        self.assertEqual(got.pop("again"), want[first_name], "the same tokens as the stream's")
        self.assertEqual(got, want, "every stream ends as an undisturbed one")
        self.assertEqual(b.figures["carried"], 3)
        self.assertEqual(b.figures["computed_again"], 0)
        self.assertGreater(b.figures["from_pool"], 0)
        self.assertGreater(b.figures["copied"], 0, "the tails the dead engine may still write were copied")
        first, = [e for e in self.events if e.get("event") == "first-steps"]
        self.assertEqual((first["how"], len(first["steps"])), ("adopted", self.b.FIRST_STEPS), first)
        self.assertEqual(set(first["steps"][0]), {"at_ms", "ms", "launch_ms", "sync_ms", "launches"})
        self.assertIn("decode", first["steps"][0]["launches"].split("+"), "carried streams decode at once")
        # The streams were taken up before any record of the pool's full
        # blocks was read (off the first answer's path); read now, they
        # hold the dead engine's prefix cache.
        self.assertGreater(b.blocks.figures["unread"], 0)
        self.assertEqual(b.blocks.read_some(1 << 20), 0)
        self.assertGreater(b.blocks.figures["adopted_cached"], 0)
        # The fence passes: what was set aside is free, nothing is held.
        b.blocks.fence_passed()
        self.assertFalse(b.blocks.aside - set(b.blocks.cached_of), b.blocks.aside)
        self.assertEqual(b.blocks.refs, {})

    def test_the_mapped_part_follows_libgms_and_a_failed_mapping_ends_the_loop(self):
        self.events = []
        b = self.engine_on(self.pool(), created=True, fenced=True)
        b.t_grant = 0.0

        class Pool:
            def __init__(self, answers):
                self.answers = answers

            def mapped(self):
                got = self.answers.pop(0)
                if isinstance(got, Exception):
                    raise got
                return got

        block = b.geo.block_bytes
        b.pool = Pool([10 * block + 5, b.geo.pool_bytes])
        b.blocks.set_mapped(4)
        b._track_mapping()
        self.assertEqual(b.blocks.limit, 10, "whole blocks of what libgms mapped so far")
        b._track_mapping()
        self.assertIsNone(b.blocks.limit)
        self.assertEqual([e["event"] for e in self.events], ["kv-pool-mapped"])
        b.pool = Pool([RuntimeError("mapping the KV pool's 2097152 bytes at +0x800000: refused")])
        b.blocks.set_mapped(4)
        with self.assertRaisesRegex(RuntimeError, "refused"):
            b._track_mapping()  # raised out of the loop: the engine exits 70

    def test_a_stream_of_another_pool_is_computed_again_to_the_same_tokens(self):
        self.events = []
        pool = self.pool()
        a = self.engine_on(pool, created=True, fenced=True)
        (name, st, prompt), = self.streams()[:1]
        job = self.submit(a, name, prompt, st)
        with torch.no_grad():
            for _ in range(10):
                a._step()
        sent = [t for t in self.drain(job) if t is not self.jobs.END]
        # A cold restart: a new pool (another id); the stream's state names
        # the old one.
        b = self.engine_on(self.pool(pool_id=8), created=True, fenced=True)
        kv = self.continuity.read_kv(st.fd)
        self.assertEqual(kv["tokens"], sent)
        b._message(("pin", name, kv))
        self.assertIsNone(b.pins[name])
        b._message(("carried_done",))
        job = self.submit(b, name, prompt, st, kv)
        got = {name: list(kv["tokens"])}
        self.run_to_end(b, {name: job}, got)
        ref = self.engine_on(self.pool(), created=True, fenced=True)
        st2 = self.continuity.State.create("ref")
        self.fds.append(st2.fd)
        want = {name: []}
        self.run_to_end(ref, {name: self.submit(ref, name, prompt, st2)}, want)
        self.assertEqual(got, want)
        done = [e for e in self.events if e.get("event") == "kv-stream-done" and e.get("name") == name]
        self.assertEqual(done[-1]["why"], "another pool")
        self.assertGreater(done[-1]["computed_again"], 0)


if __name__ == "__main__":
    unittest.main()
