#!/usr/bin/env python3
"""A small real PyTorch engine that follows the shadow engine contract.

A few transformer-style layers (hidden 4096 by default) with random weights
generated from a seed, a real forward pass on the GPU with a KV cache, and
an HTTP server (POST /v1/completions, GET /health). Weights come through
GMS: the first engine (lease rw) generates and commits them, every later
engine (lease ro) maps the committed weights read-only at the same
addresses. Then, per docs/engine-contract.md:

  1. initialise (weights, a warm-up forward that loads the kernels);
  2. STATUS=parked on NOTIFY_SOCKET;
  3. flock(LOCK_EX) on SHADOW_LOCK_PATH;
  4. wake: launch the check of the mapped weights against the digest
     their writer recorded (on the GPU), and bind the port (or, with an
     inherited listening socket, start accepting on it);
  5. READY=1, then serve; the check's verdict is awaited before the first
     answer is sent (it overlaps the first request), and once that answer
     is out the KV cache starts growing at its reserved address (libgms backs what fits now
     and the rest as the dead engine's memory comes back; the engine does
     not wait for it; a request that needs KV rows starts it sooner): a request whose KV rows are backed runs at once,
     one whose rows are not yet waits until the cache has grown (those
     behind it wait in the listen backlog). The KV cache is laid out token
     after token (every layer's K and V of token 0, then of token 1, ...),
     so that its backed prefix holds whole tokens: a request of n tokens
     needs the first n rows. Short requests run on the CUDA-graph path,
     whose window is the engine's own, and need none of it.

A reader checks the weights once more right after mapping them. Weights
that changed since their commit (on CUDA any holder of the handle can
write them) end the engine with status 65 (CORRUPT_EXIT): the runtime
restarts the pair cold and the weights are generated again.

With LISTEN_FDS (a pair with shadow.dev/listen) the engine takes the pair's
listening socket at start, holds it while parked without accepting, and
serves on it once active: connections that arrive during a failover wait
in its backlog instead of being refused. Without it, it binds ENGINE_PORT.

With the pair's fd store (NOTIFY_SOCKET and SHADOW_FDSTORE_SOCKET, unless
ENGINE_NO_FDSTORE=1) every connection is stored the moment it is accepted,
with a memfd of what its request needs to be resumed (continuity.py), and
removed once answered; one request per connection (Connection: close). A
promoted engine fetches the store once READY=1 is sent, on a thread of its
own while it serves new connections, and then finishes every answer the
dead engine had begun before the next new one: a request
not yet answered is answered, a streamed completion continues right after
the last byte the client has (the socket counts what was written), with
the same tokens, recomputed from the prompt. POST /v1/completions speaks
OpenAI's completions API, "stream": true as server-sent events ending with
``data: [DONE]``. With SHADOW_ACCEPT=runtime (shadow.dev/accept: runtime) the
inherited socket is a hand-off socket: the runtime accepts, keeps each
connection in the store from the moment it exists, and hands it to the
serving engine, which stores only the state memfd beside it.

With a watchdog (WATCHDOG_USEC, shadow.dev/watchdog) the main process pings
WATCHDOG=1 each half interval from the loops that work, never from a timer:
while parked from its wait for the lock (the flock waits in a thread; the
lock taken, the wake goes on without waiting for a ping), while serving
from the serving loop and from each decode step. In a TP group it pings
only while every rank beats (tp.py, heartbeat.py). A stuck step, or a rank
stuck in a kernel or a collective, stops the pings and the runtime ends the
engine. SHADOW_TEST_HANG=1 adds POST /test/hang for tests: it answers, then
starts a GPU kernel that never ends and waits for it in the serving path
(``{"rank": r}``: on rank r of a group instead, which stops beating).

Environment: SHADOW_ENGINE_ID, SHADOW_LOCK_PATH, NOTIFY_SOCKET,
GMS_SOCKET_DIR, LISTEN_FDS/LISTEN_PID/LISTEN_FDNAMES (as the shim sets
them); ENGINE_PORT (default 8000),
ENGINE_SEED, ENGINE_LAYERS, ENGINE_HIDDEN, ENGINE_KV_GIB (per GPU), GMS_LIB,
ENGINE_TP (default 1: N > 1 runs N ranks, one per GPU, tp.py),
WATCHDOG_USEC/WATCHDOG_PID (as the shim sets them), SHADOW_FDSTORE_SOCKET
(as the shim sets it), ENGINE_NO_FDSTORE, SHADOW_TEST_HANG.
Prints one JSON line per phase on stdout.
"""

import json
import math
import os
import select
import socket
import sys
import threading
import time

# cuBLAS workspaces of 16 MiB per stream, not the 32 MiB torch gives Hopper,
# set before torch starts cuBLAS: a parked engine keeps one per stream it
# ever ran a GEMM on (two here), and the parked shadow's budget is 800 MiB.
# On an H200 this engine's requests took as long with 8 MiB as with 32.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:4")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "gms", "python"))
from shadow_gms import (CORRUPT_EXIT, FailoverLock, FdStoreError, Gms, Watchdog, WeightsCorrupt,  # noqa: E402
                        accepted_by_runtime, bytes_written, fdstore_fetch, fdstore_inherited, fdstore_remove,
                        fdstore_store, handoff_receive, listen_socket, notify)
from heartbeat import Heartbeat  # noqa: E402
import continuity  # noqa: E402
from continuity import Continuity, Plain, Stream  # noqa: E402

VOCAB = 32000
HEAD_DIM = 128
DTYPE = torch.bfloat16
# Tests only: POST /test/hang. Never set in production.
TEST_HANG = os.environ.get("SHADOW_TEST_HANG") == "1"


_LOG_LOCK = threading.Lock()


def log(**fields):
    """One JSON line on stdout, whole (the store's fetch logs from a thread
    of its own)."""
    fields.setdefault("t", round(time.time(), 6))
    line = json.dumps(fields) + "\n"
    with _LOG_LOCK:
        sys.stdout.write(line)
        sys.stdout.flush()


class Layer(torch.nn.Module):
    def __init__(self, hidden, device):
        super().__init__()
        kw = dict(device=device, dtype=DTYPE)
        self.norm1 = torch.nn.Parameter(torch.empty(hidden, **kw))
        self.qkv = torch.nn.Parameter(torch.empty(3 * hidden, hidden, **kw))
        self.out = torch.nn.Parameter(torch.empty(hidden, hidden, **kw))
        self.norm2 = torch.nn.Parameter(torch.empty(hidden, **kw))
        self.up = torch.nn.Parameter(torch.empty(4 * hidden, hidden, **kw))
        self.down = torch.nn.Parameter(torch.empty(hidden, 4 * hidden, **kw))

    def forward(self, x, k_cache, v_cache, pos):
        t, h = x.shape
        heads = h // HEAD_DIM
        q, k, v = F.linear(F.rms_norm(x, (h,), self.norm1), self.qkv).split(h, dim=-1)
        k_cache[pos:pos + t] = k
        v_cache[pos:pos + t] = v
        keys = k_cache[:pos + t].view(pos + t, heads, HEAD_DIM).transpose(0, 1)
        vals = v_cache[:pos + t].view(pos + t, heads, HEAD_DIM).transpose(0, 1)
        q = q.view(t, heads, HEAD_DIM).transpose(0, 1)
        # Prefill from position 0 is causal; a one-token decode sees everything.
        a = F.scaled_dot_product_attention(q, keys, vals, is_causal=(pos == 0 and t > 1))
        x = x + F.linear(a.transpose(0, 1).reshape(t, h), self.out)
        return x + F.linear(F.silu(F.linear(F.rms_norm(x, (h,), self.norm2), self.up)), self.down)

    def decode(self, x, k_cache, v_cache, pos, mask):
        """One token at position ``pos`` (a 1-element tensor) attending over
        a fixed window of the cache, ``mask`` hiding the rows past ``pos``:
        every shape and address fixed, as a CUDA graph needs."""
        h = x.shape[1]
        heads, window = h // HEAD_DIM, mask.shape[-1]
        q, k, v = F.linear(F.rms_norm(x, (h,), self.norm1), self.qkv).split(h, dim=-1)
        k_cache.index_copy_(0, pos, k)
        v_cache.index_copy_(0, pos, v)
        keys = k_cache[:window].view(window, heads, HEAD_DIM).transpose(0, 1)
        vals = v_cache[:window].view(window, heads, HEAD_DIM).transpose(0, 1)
        q = q.view(1, heads, HEAD_DIM).transpose(0, 1)
        a = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask)
        x = x + F.linear(a.transpose(0, 1).reshape(1, h), self.out)
        return x + F.linear(F.silu(F.linear(F.rms_norm(x, (h,), self.norm2), self.up)), self.down)


class Model(torch.nn.Module):
    def __init__(self, layers, hidden, device):
        super().__init__()
        self.hidden = hidden
        self.embed = torch.nn.Parameter(torch.empty(VOCAB, hidden, device=device, dtype=DTYPE))
        self.layers = torch.nn.ModuleList(Layer(hidden, device) for _ in range(layers))
        self.norm = torch.nn.Parameter(torch.empty(hidden, device=device, dtype=DTYPE))

    @torch.no_grad()
    def init_from_seed(self, seed):
        gen = torch.Generator(device="cuda").manual_seed(seed)
        for name, p in self.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]), generator=gen)

    @torch.no_grad()
    def forward(self, tokens, kv, pos):
        x = self.embed[tokens]
        for i, layer in enumerate(self.layers):
            x = layer(x, kv[i][0], kv[i][1], pos)
        return F.linear(F.rms_norm(x[-1:], (self.hidden,), self.norm), self.embed)

    @torch.no_grad()
    def generate(self, tokens, max_tokens, kv, step=None, emit=None):
        """``step`` is called after each decode step (its token read back:
        the step is done on the GPU), for the watchdog; ``emit`` with each
        token as it is decoded (a streamed answer's events)."""
        max_seq = kv[0][0].shape[0]
        tokens = tokens[-(max_seq - max_tokens):]
        ids = torch.tensor(tokens, device="cuda")
        logits = self.forward(ids, kv, 0)
        out, pos = [], len(tokens)
        for _ in range(max_tokens):
            nxt = int(logits.argmax(-1)[0])
            out.append(nxt)
            if emit is not None:
                emit(nxt)
            if step is not None:
                step()
            logits = self.forward(torch.tensor([nxt], device="cuda"), kv, pos)
            pos += 1
        return out


class FastPath:
    """Short requests (prompt and answer within WINDOW tokens) on a KV window
    of the engine's own, with each decode step one CUDA graph replay and one
    host sync per request instead of one per token.

    The graph is captured while parked, over the weights' GMS addresses
    (the same in every engine of the pair) and this window; a promoted
    engine replays what it captured, which is what the shadow pattern is
    for. The window is ordinary device memory (8 MiB at 8 layers), zeroed
    once: rows past a request's position are masked out of attention but
    still multiplied by zero, so they must hold numbers. Longer requests
    take the eager path over the KV cache, once the rows they need
    are backed."""

    WINDOW = 64
    MAX_TOKENS = 256

    def __init__(self, model, layers, hidden):
        self.model, self.hidden = model, hidden
        self.cache = torch.zeros(2 * layers * self.WINDOW * hidden, device="cuda", dtype=DTYPE)
        self.caches = kv_views(self.cache, layers, hidden, self.WINDOW)
        self.tok = torch.zeros(1, dtype=torch.long, device="cuda")
        self.pos = torch.zeros(1, dtype=torch.long, device="cuda")
        self.step = torch.zeros(1, dtype=torch.long, device="cuda")
        self.out = torch.zeros(self.MAX_TOKENS, dtype=torch.long, device="cuda")
        self.positions = torch.arange(self.WINDOW, device="cuda")
        # Run before captured (torch's advice), on the stream that captures:
        # each stream that runs a GEMM gets a cuBLAS workspace of its own,
        # and a parked engine should hold one more, not two.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side), torch.no_grad():
            for _ in range(2):
                self._step()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, stream=side), torch.no_grad():
            self._step()
        torch.cuda.synchronize()

    def _step(self):
        """Decodes self.tok at self.pos; writes the next token into self.out
        at self.step and into self.tok, and moves pos and step on."""
        m = self.model
        mask = (self.positions <= self.pos).view(1, 1, self.WINDOW)
        x = m.embed[self.tok]
        for i, layer in enumerate(m.layers):
            x = layer.decode(x, self.caches[i][0], self.caches[i][1], self.pos, mask)
        nxt = F.linear(F.rms_norm(x, (self.hidden,), m.norm), m.embed).argmax(-1)
        self.out.index_copy_(0, self.step, nxt)
        self.tok.copy_(nxt)
        self.pos.add_(1)
        self.step.add_(1)

    def fits(self, tokens, max_tokens):
        return 0 < len(tokens) and len(tokens) + max_tokens <= self.WINDOW and max_tokens <= self.MAX_TOKENS

    @torch.no_grad()
    def generate(self, tokens, max_tokens):
        """As Model.generate: the prefill eager, then max_tokens - 1 replays
        (at most WINDOW: no step hook, the one sync is at the end)."""
        logits = self.model.forward(torch.tensor(tokens, device="cuda"), self.caches, 0)
        self.tok.copy_(logits.argmax(-1))
        self.out[:1].copy_(self.tok)
        self.pos.fill_(len(tokens))
        self.step.fill_(1)
        for _ in range(max_tokens - 1):
            self.graph.replay()
        return self.out[:max_tokens].tolist()


def kv_views(base, layers, hidden, max_seq):
    """Per-layer (K, V) tensors of [max_seq, hidden] carved from one range,
    layer after layer (the CUDA-graph window)."""
    per = max_seq * hidden
    flat = base[: 2 * layers * per]
    return [(flat[(2 * i) * per:(2 * i + 1) * per].view(max_seq, hidden),
             flat[(2 * i + 1) * per:(2 * i + 2) * per].view(max_seq, hidden)) for i in range(layers)]


def token_views(base, layers, hidden, max_seq):
    """Per-layer (K, V) tensors of [max_seq, hidden] over one range laid out
    token after token ([max_seq, layers, 2, hidden]): row r of every layer
    lies in the range's r-th slice of ``row_bytes``, so a cache backed up to
    byte b holds rows 0 .. b // row_bytes whole."""
    rows = base[: max_seq * layers * 2 * hidden].view(max_seq, layers, 2, hidden)
    return [(rows[:, i, 0], rows[:, i, 1]) for i in range(layers)]


def row_bytes(layers, hidden):
    """Bytes of one token's K and V in every layer (token_views)."""
    return layers * 2 * hidden * torch.empty((), dtype=DTYPE).element_size()


class KvUnavailable(Exception):
    """The KV rows a request needs are not backed and the cache stopped growing."""


class KvAdmission:
    """Admits a request once the KV rows it needs are backed: at once when
    they are, else after waiting (pinging the watchdog, since waiting for
    memory is progress) until the cache has grown; fails with KvUnavailable
    when the cache stopped growing short of them."""

    SLICE_S = 0.05

    def __init__(self, kv, row):
        self.kv, self.row = kv, row

    def admit(self, rows, step=None):
        need = rows * self.row
        if need > self.kv.nbytes:
            raise KvUnavailable(f"{rows} rows exceed the KV cache of {self.kv.nbytes // self.row} rows")
        if self.kv.backed >= need:
            return
        t0 = time.perf_counter()
        while True:
            if self.kv.wait(need, self.SLICE_S) >= need:
                break
            if step is not None:
                step()
            info = self.kv.info()
            if info["growth"] != "growing" and info["backed"] < need:
                raise KvUnavailable(f"{rows} KV rows needed, {info['backed'] // self.row} backed: {info}")
        log(event="kv-admitted", rows=rows, waited_ms=round((time.perf_counter() - t0) * 1e3, 3),
            backed=self.kv.backed)


def main():
    engine_id = os.environ.get("SHADOW_ENGINE_ID", "0")
    port = int(os.environ.get("ENGINE_PORT", "8000"))
    seed = int(os.environ.get("ENGINE_SEED", "1234"))
    layers = int(os.environ.get("ENGINE_LAYERS", "8"))
    hidden = int(os.environ.get("ENGINE_HIDDEN", "4096"))
    kv_bytes = int(float(os.environ.get("ENGINE_KV_GIB", "8")) * (1 << 30))
    tp = int(os.environ.get("ENGINE_TP", "1"))
    if tp > 1 or "ENGINE_RANK" in os.environ:
        import tp as tensor_parallel  # noqa: E402 (needs torch.distributed: only when asked for)
        if "ENGINE_RANK" in os.environ:
            return tensor_parallel.run_rank(os.path.abspath(__file__))
    t_start = time.perf_counter()
    # The watchdog (None of it without WATCHDOG_USEC), for the whole group.
    heartbeat = Heartbeat(Watchdog(), ranks=max(0, tp - 1))
    # The pair's socket, if handed down: held from now on, accepted on only
    # once active.
    inherited = listen_socket()
    # The store's descriptors handed at start: fetched instead once this
    # engine takes over (a parked engine holding copies of every stored
    # connection would keep them open after they are answered).
    for _, fd in fdstore_inherited():
        os.close(fd)

    if tp > 1:
        # 1. initialise the group: ranks, shards through each GPU's GMS, NCCL.
        # Rank 0's shard is checked here when mapped (ranks 1.. check theirs).
        group = verify_or_exit(engine_id, lambda: tensor_parallel.Group(
            tp, os.path.abspath(__file__), engine_id, layers, hidden, seed, kv_bytes, log, heartbeat), "mapped",
            figures=False)
        kv = group.kv
        log(event="weights", engine=engine_id, lease=group.own.gms.lease, tp=tp,
            source="generated+committed" if group.own.gms.lease == "rw" else "mapped read-only",
            addr=hex(group.own.model.embed.data_ptr()))
        log(event="parked", engine=engine_id, pid=os.getpid(), tp=tp, kv_addr=hex(kv.addr),
            kv_bytes=kv.nbytes, init_s=round(time.perf_counter() - t_start, 3))
        # The group checks every rank's shard on wake, before it accepts.
        wake, hang = (lambda: Done(group.wake() or {})), group.hang

        def generate(tokens, max_tokens, step=None, emit=None):
            return emitted(group.generate(tokens, max_tokens, step), emit)
    else:
        kv, wake, generate = one_gpu(engine_id, layers, hidden, seed, kv_bytes, t_start)
        hang = None
    serve(engine_id, port, inherited, kv, wake, generate, heartbeat, hang)


def hang_gpu():
    """SHADOW_TEST_HANG's stuck step: a kernel that never ends (2**62 clock
    cycles), and a host that waits for it (tp.py has the ranks' copy)."""
    torch.cuda._sleep(2 ** 62)
    torch.cuda.synchronize()


SHORT_PROMPTS = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32)
# The eager path's prompts up to the warm-up cache's rows (WARM_ROWS).
LONG_PROMPTS = SHORT_PROMPTS + (48, 64, 96, 128, 192, 256, 384, 496)
WARM_ROWS = 512


def warm_up(generate, caches, prompts=SHORT_PROMPTS):
    """Runs every shape a request of these prompt lengths meets: CUDA
    loads a kernel on its first use, and cuBLAS and attention pick theirs
    by shape, which costs milliseconds on the first request of each kind.
    A parked engine pays that now, not its first request after a
    promotion."""
    for n in prompts:
        generate(list(range(1, n + 1)), 16 if n > 32 else 4, caches)
    torch.cuda.synchronize()


def one_gpu(engine_id, layers, hidden, seed, kv_bytes, t_start):
    """TP=1: the model, its weights through GMS and its KV cache reserved;
    returns (kv, wake, generate)."""
    # 1. initialise: weights through GMS (rw_or_ro).
    gms = Gms(mode="rw_or_ro", client=f"torch-engine-{engine_id}", timeout_s=300)
    t0 = time.perf_counter()
    if gms.lease == "rw":
        with gms.weights_pool():
            model = Model(layers, hidden, "cuda")
            model.init_from_seed(seed)
        generation = gms.commit_module(model)
        source = "generated+committed"
    else:
        model = gms.load_module(Model(layers, hidden, "meta"))
        generation = gms.layout()["generation"]
        source = "mapped read-only"
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    log(event="weights", engine=engine_id, lease=gms.lease, source=source, generation=generation,
        bytes=weight_bytes, ms=round((time.perf_counter() - t0) * 1e3, 2),
        addr=hex(model.embed.data_ptr()))
    if source == "mapped read-only":
        verify_or_exit(engine_id, gms.verify_weights, "mapped")

    kv = gms.kv_cache(kv_bytes)
    row = row_bytes(layers, hidden)
    max_seq = kv.nbytes // row
    # Warm-up on a small scratch cache laid out as the KV cache is: kernels,
    # cuBLAS handles, allocator.
    scratch = torch.empty(2 * layers * WARM_ROWS * hidden, device="cuda", dtype=DTYPE)
    warm_up(model.generate, token_views(scratch, layers, hidden, WARM_ROWS), LONG_PROMPTS)
    del scratch
    # Short requests: a decode step captured as a CUDA graph, while parked.
    fast = FastPath(model, layers, hidden)
    warm_up(lambda tokens, n, _caches: fast.generate(tokens, n), None)
    # The promotion's weights check, recorded as one CUDA graph.
    gms.prepare_verify_weights(capture=True)
    # A parked engine holds what it needs and no cached leftovers.
    torch.cuda.empty_cache()
    log(event="parked", engine=engine_id, pid=os.getpid(), kv_addr=hex(kv.addr), kv_bytes=kv.nbytes,
        init_s=round(time.perf_counter() - t_start, 3), torch_reserved_mib=torch.cuda.memory_reserved() >> 20)
    caches = []
    admission = KvAdmission(kv, row)

    woke = []

    def grow():
        """Starts the KV cache growing, once: libgms backs what fits now
        and the rest as memory comes back, off this thread."""
        if not woke:
            woke.append(time.perf_counter())
            kv.wake(0)
            watch_kv_growth(engine_id, kv, woke[0])

    def wake():
        """Launches the weights check on the GPU; returns it. Its verdict
        is taken before the first answer, and then the KV cache starts
        growing (or sooner, for the first request that needs KV rows):
        during a failover libgms's driver calls are slowed by the dead
        engine's teardown, and kept out of the first request."""
        t0 = time.perf_counter()
        pending = gms.begin_verify_weights()
        t1 = time.perf_counter()
        return Check(pending, then=grow, launch_ms=round((t1 - t0) * 1e3, 3))

    def generate(tokens, max_tokens, step=None, emit=None):
        if fast.fits(tokens, max_tokens):
            return emitted(fast.generate(tokens, max_tokens), emit)
        # The rows Model.generate uses: the prompt (cut to what leaves room
        # for the answer) and the answer.
        grow()
        admission.admit(min(len(tokens), max_seq - max_tokens) + max_tokens, step)
        if not caches:
            # Made once the cache's start is backed: torch asks the driver
            # where a pointer lives, and an address not mapped yet has no
            # answer.
            caches.extend(token_views(kv.tensor(DTYPE), layers, hidden, max_seq))
        return model.generate(tokens, max_tokens, caches, step, emit)

    return kv, wake, generate


def emitted(out, emit):
    """Tokens decoded all at once (the CUDA-graph path, a TP group): each
    emitted once they are all there."""
    if emit is not None:
        for t in out:
            emit(t)
    return out


class Check:
    """A promoted engine's weights check under way: ``result()`` waits for
    the GPU and returns its figures (``checked: False`` without a digest), or raises
    WeightsCorrupt."""

    def __init__(self, pending, then=None, **figures):
        self.pending, self.then, self.figures = pending, then, figures
        self.t0 = time.perf_counter()

    def result(self):
        checked = self.pending.result() if self.pending is not None else {"checked": False}
        return dict(checked, wait_ms=round((time.perf_counter() - self.t0) * 1e3, 3), **self.figures)


class Done:
    """A check already finished (a TP group checks every rank on wake)."""

    then = None

    def __init__(self, figures):
        self.figures = figures

    def result(self):
        return self.figures


def watch_kv_growth(engine_id, kv, since):
    """Logs "kv-backed" once the KV cache stops growing (all of it backed,
    or stalled), from a thread that waits in libgms (the GIL released)."""
    def run():
        while kv.wait(kv.nbytes, 1.0) < kv.nbytes:
            if kv.info()["growth"] != "growing":
                break
        info = kv.info()
        log(event="kv-backed", engine=engine_id, ms=round((time.perf_counter() - since) * 1e3, 3), **info)
    threading.Thread(target=run, name="kv-growth", daemon=True).start()


def verify_or_exit(engine_id, check, when, figures=True):
    """Runs ``check`` (something that checks the weights); on WeightsCorrupt
    says why and exits with CORRUPT_EXIT (the runtime restarts the pair
    cold). Returns what ``check`` returned: with ``figures``, the check's
    figures (None: the layout has no digest), logged."""
    try:
        out = check()
    except WeightsCorrupt as e:
        log(event="weights-corrupt", engine=engine_id, when=when, error=str(e))
        notify(f"STATUS=weights corrupt ({when}): {e}"[:200])
        os._exit(CORRUPT_EXIT)
    if figures:
        log(event="weights-verified", engine=engine_id, when=when, **(out or {"checked": False}))
    return out


def store_enabled():
    """Whether this engine keeps its connections in the pair's fd store:
    the runtime has one (NOTIFY_SOCKET and SHADOW_FDSTORE_SOCKET), and
    ENGINE_NO_FDSTORE=1 does not turn it off."""
    return bool(os.environ.get("NOTIFY_SOCKET") and os.environ.get("SHADOW_FDSTORE_SOCKET")
                and (os.environ.get("ENGINE_NO_FDSTORE") != "1" or accepted_by_runtime()))


# A refused fetch (the runtime has not yet seen this engine take the lock)
# is tried again after these pauses, in s: short first, since the runtime
# sees the lock within milliseconds, then longer, about 2 s in all.
FETCH_RETRY_S = (0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.5, 1.0)


def take_store(engine_id):
    """The fd store, fetched once this engine holds the lock: every
    connection the dead engine held, [(name, fd)], and the attempts it
    took."""
    if not store_enabled():
        return [], 0
    t0 = time.perf_counter()
    for attempt, pause in enumerate(FETCH_RETRY_S + (None,), start=1):
        try:
            got = fdstore_fetch() or []
            log(event="fdstore-fetched", engine=engine_id, fds=len(got), attempt=attempt,
                ms=round((time.perf_counter() - t0) * 1e3, 3))
            return got, attempt
        except (FdStoreError, OSError) as e:
            # The store answers the lock's holder: a refusal while the
            # runtime cannot tell who holds it is tried again.
            log(event="fdstore-fetch-failed", engine=engine_id, attempt=attempt, error=str(e))
            if pause is None:
                break
            time.sleep(pause)
    # What the dead engine held stays in the store; this engine serves new
    # requests.
    return [], len(FETCH_RETRY_S) + 1


class Takeover:
    """The fetch of the store, on a thread of its own, so that new
    connections are served while it waits on the runtime (which is busiest
    right after a failover); the serving loop resumes what it fetched as
    soon as it is in, before the next new connection. ``fileno()`` is
    readable once it is."""

    def __init__(self, engine_id, since):
        self.since = since
        self.done_ms = self.attempts = None
        self._got = None
        self._r, self._w = os.pipe()
        os.set_blocking(self._r, False)
        self._thread = threading.Thread(target=self._run, args=(engine_id,), name="fdstore-fetch", daemon=True)
        self._thread.start()

    def _run(self, engine_id):
        try:
            got, attempts = take_store(engine_id)
        except Exception as e:  # noqa: BLE001 (logged; this engine serves new requests)
            log(event="fdstore-fetch-failed", engine=engine_id, error=repr(e))
            got, attempts = [], None
        self._got, self.attempts = got, attempts
        self.done_ms = round((time.perf_counter() - self.since) * 1e3, 3)
        os.write(self._w, b"x")

    def fileno(self):
        return self._r

    def take(self):
        """What was fetched, once (None before the fetch is in)."""
        try:
            os.read(self._r, 1)
        except BlockingIOError:
            return None
        os.close(self._r)
        os.close(self._w)
        got, self._got = self._got, None
        return got


def next_connection(server, handed, cont):
    """The next connection, stored: handed over by the runtime (in the
    store already), or accepted here and stored at once; None when there
    was none after all."""
    if handed:
        try:
            got = handoff_receive(server)
        except (BlockingIOError, InterruptedError):
            return None
        except ValueError as e:
            log(event="handoff-refused", error=str(e))
            return None
        if got is None:
            log(event="handoff-closed", why="the runtime closed the hand-off socket: the pair ended")
            sys.exit(1)
        name, sock = got
        return cont.handed(sock, name)
    try:
        sock, _ = server.accept()
    except (BlockingIOError, InterruptedError):
        return None
    return cont.accepted(sock)


def listening(port, inherited):
    if inherited is not None:
        return inherited
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))
    sock.listen(128)
    return sock


def serve(engine_id, port, inherited, kv, wake, generate, heartbeat, hang=None):
    """Steps 2-5 of the contract, the same for one process and a group.
    ``heartbeat`` paces the watchdog's pings; ``hang(rank)`` makes rank
    ``rank`` of a group hang (SHADOW_TEST_HANG)."""
    # 2-3. park on the election lock, pinging while parked.
    notify(f"STATUS=parked engine {engine_id}", f"MAINPID={os.getpid()}")
    lock = FailoverLock().acquire(watchdog=heartbeat)
    t_wake = time.perf_counter()
    woke_at = time.time()

    # 4. wake: the weights check is launched (a group also backs every
    # rank's KV cache and checks every shard first), then the port taken
    # (the store is fetched once READY=1 is sent, on a thread of its own).
    # The check runs on the GPU while the engine accepts and starts on its
    # first request; nothing is written before it has passed, and the KV
    # cache starts growing once the first answer is out.
    check = verify_or_exit(engine_id, wake, "promoted", figures=False)
    wake_ms = (time.perf_counter() - t_wake) * 1e3
    serve_lock = threading.Lock()
    unchecked = [check]
    # Run once the first answer is out (or at the first idle moment): the
    # KV cache's growth, whose driver calls compete with the dead
    # context's teardown.
    after_first = []
    # The promoted engine's path from the lock to its first answer, in ms
    # from the lock (logged with the first answer).
    path = {}
    # What the serving loop has in hand: ("new" or "resumed", ms from the lock).
    serving = (None, None)

    def since_lock():
        return round((time.perf_counter() - t_wake) * 1e3, 3)

    def settle():
        """The weights check's verdict, before the first answer (or at the
        first idle moment): on a mismatch the engine exits (CORRUPT_EXIT)
        without answering."""
        if unchecked:
            check = unchecked.pop()
            t0 = time.perf_counter()
            verify_or_exit(engine_id, check.result, "promoted")
            path["verdict_wait_ms"] = round((time.perf_counter() - t0) * 1e3, 3)
            if check.then is not None:
                after_first.append(check.then)

    def grow_now():
        while after_first:
            after_first.pop()()

    def before_write():
        settle()
        if "first_answer_ms" not in path:
            path["first_answer_ms"] = since_lock()
            # The connection this answer is on: new, or resumed from the store.
            path["first_conn"], path["first_conn_ms"] = serving
            if takeover is not None:
                fetch_done(takeover)
            path.setdefault("fetched_ms", None)
            path.setdefault("fetch_attempts", None)
            log(event="first-answer", engine=engine_id, ms=path["first_answer_ms"], **path)

    def fetch_done(t):
        if t.done_ms is not None:
            path.setdefault("fetched_ms", t.done_ms)
            path.setdefault("fetch_attempts", t.attempts)

    def test_hang(body):
        """SHADOW_TEST_HANG=1 only: answers, then hangs a GPU step in the
        serving path (rank 0), or has rank ``rank`` of a group hang."""
        try:
            rank = int(json.loads(body or b"{}").get("rank", 0))
        except (ValueError, TypeError, AttributeError) as e:
            return Plain(400, {"error": f"bad request: {e}"})
        ranks = heartbeat.ranks
        if not 0 <= rank <= ranks:
            return Plain(400, {"error": f"rank {rank}: this engine has ranks 0..{ranks}"})

        def hang_now():
            log(event="test-hang", engine=engine_id, rank=rank)
            if rank == 0:
                with serve_lock:
                    hang_gpu()
            else:
                hang(rank)

        return Plain(200, {"hanging": rank, "engine": engine_id, "pid": os.getpid()}, after=hang_now)

    def answer(method, path, body, head):
        """One request: OpenAI's completions (plain, or streamed as
        server-sent events), /health, and the test hang."""
        if method == "GET" and path == "/health":
            return Plain(200, {"engine": engine_id, "role": "active", "pid": os.getpid()})
        if method == "POST" and TEST_HANG and path == "/test/hang":
            return test_hang(body)
        if method != "POST" or path != "/v1/completions":
            return Plain(404, {"error": "not found"})
        try:
            req = json.loads(body or b"{}")
            prompt = str(req.get("prompt", ""))
            max_tokens = max(1, min(int(req.get("max_tokens", 8)), 256))
            stream = bool(req.get("stream", False))
        except (ValueError, TypeError, AttributeError) as e:
            return Plain(400, {"error": f"bad request: {e}"})
        tokens = [b % VOCAB for b in prompt.encode()] or [0]
        if stream:
            def run(emit):
                with serve_lock:
                    generate(tokens, max_tokens, heartbeat.ping, lambda t: emit(chr(32 + t % 95)))
            return Stream(len(tokens), run)
        try:
            with serve_lock:
                out = generate(tokens, max_tokens, heartbeat.ping)
        except KvUnavailable as e:
            return Plain(503, {"error": f"KV cache: {e}"})
        text = "".join(chr(32 + t % 95) for t in out)
        return Plain(200, {"id": head["id"], "object": "text_completion", "created": head["created"],
                           "model": continuity.MODEL, "engine": engine_id, "pid": os.getpid(),
                           "choices": [{"index": 0, "text": text, "tokens": out, "finish_reason": "length"}],
                           "usage": {"prompt_tokens": len(tokens), "completion_tokens": len(out),
                                     "total_tokens": len(tokens) + len(out)}})

    cont = Continuity(answer, fdstore_store, fdstore_remove, bytes_written, enabled=store_enabled(), log=log)
    cont.before_write = before_write
    # One connection at a time, on the loop that pings: with a watchdog a
    # client that stalls mid-request loses it after a quarter interval
    # rather than hold the pings back (without one it waits).
    client_timeout = heartbeat.watchdog.interval / 4 if heartbeat.enabled else None
    server = listening(port, inherited)
    # Handed its connections (the runtime accepts): `server` is the
    # hand-off socket, and the fetch once active is what makes them go here.
    handed = inherited is not None and accepted_by_runtime()
    port = port if handed else server.getsockname()[1]
    promote_ms = (time.perf_counter() - t_wake) * 1e3

    # 5. ready.
    notify("READY=1", f"STATUS=active engine {engine_id}", f"MAINPID={os.getpid()}")
    path["ready_ms"] = since_lock()
    log(event="active", engine=engine_id, pid=os.getpid(), woke_at=woke_at,
        wake_ms=round(wake_ms, 3), kv_bytes=kv.nbytes, promote_ms=round(promote_ms, 3), port=port,
        socket="handed" if handed else "inherited" if inherited is not None else "own", fdstore=cont.enabled)
    # What the dead engine was answering: fetched after READY=1 (which then
    # never waits on the runtime's answer), on a thread, while new
    # connections are served; resumed first once in, since those clients
    # have waited longest.
    takeover = Takeover(engine_id, t_wake) if cont.enabled else None

    def resume_fetched():
        nonlocal takeover, serving
        fetched = takeover.take()
        if fetched is None:
            return
        fetch_done(takeover)
        takeover = None
        conns = cont.take_over(fetched)
        if conns:
            t0 = time.perf_counter()
            for conn in conns:
                serving = ("resumed", since_lock())
                conn.sock.settimeout(client_timeout)
                cont.resume(conn, timeout=client_timeout)
                heartbeat.ping()
                grow_now()
            log(event="resumed", engine=engine_id, connections=len(conns),
                ms=round((time.perf_counter() - t0) * 1e3, 3), **cont.stats)

    try:
        # The serving loop: one request at a time, and between them (at
        # least each time a ping is due) a ping if every rank beat.
        while True:
            waiting = [server] if takeover is None else [takeover, server]
            if unchecked and not select.select(waiting, [], [], 0)[0]:
                settle()  # nobody waiting: the check's verdict now
                grow_now()
            ready = select.select(waiting, [], [], heartbeat.wait())[0]
            if takeover is not None and takeover in ready:
                resume_fetched()
            elif server in ready:
                conn = next_connection(server, handed, cont)
                if conn is not None:
                    serving = ("new", since_lock())
                    conn.sock.settimeout(client_timeout)
                    cont.serve(conn, timeout=client_timeout)
                    grow_now()
            heartbeat.ping()
    finally:
        lock.release()


if __name__ == "__main__":
    main()
