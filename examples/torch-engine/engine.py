#!/usr/bin/env python3
"""A small real PyTorch engine that follows the shadow engine contract.

A few transformer-style layers (hidden 4096 by default) with random weights
generated from a seed, a real forward pass on the GPU (or the CPU,
ENGINE_DEVICE=cpu), and an HTTP server
(POST /v1/completions, GET /health). Weights come through GMS: the first
engine (lease rw) generates and commits them, every later engine (lease ro)
maps the committed weights read-only at the same addresses. On one GPU it
is a batching engine (batching.py): one thread runs the model over every
request in flight, its KV cache paged in the pair's KV pool (gmsd's memory,
which outlives the engine), with a prefix cache and each decode step one
CUDA graph replay. Then, per docs/engine-contract.md:

  1. initialise (weights; the batch loop's thread runs every shape once on
     scratch memory, reserves the KV pool's addresses and captures the
     prompt chunk and the decode step over them);
  2. STATUS=parked on NOTIFY_SOCKET;
  3. flock(LOCK_EX) on SHADOW_LOCK_PATH;
  4. wake: launch the check of the mapped weights against the digest
     their writer recorded (on the GPU), have the batch loop ask for the
     KV pool's lease (it maps the pool where the graphs expect it, and
     takes up what the engine before left in it), and bind the port (or,
     with an inherited listening socket, start accepting on it);
  5. READY=1, then serve; the check's verdict is awaited before the first
     answer is sent (it overlaps the first request).

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
removed once answered; one request per connection (Connection: close).
Each connection is served on a thread of its own. A promoted engine
fetches the store once READY=1 is sent, on a thread of its own while it
serves new connections, pins the pool's blocks every fetched stream
names, and resumes each connection on a thread: a request not yet
answered is answered, a streamed completion continues right after the
last byte the client has (the socket counts what was written), from the
last token whose KV the dead engine committed to the pool, with nothing
computed again (a stream whose KV cannot be taken up, from another pool,
is computed again from its prompt, the same tokens). POST /v1/completions
speaks OpenAI's completions API, "stream": true as server-sent events
ending with ``data: [DONE]``. With SHADOW_ACCEPT=runtime
(shadow.dev/accept: runtime) the inherited socket is a hand-off socket:
the runtime accepts, keeps each connection in the store from the moment
it exists, and hands it to the serving engine, which stores only the
state memfd beside it.

With a watchdog (WATCHDOG_USEC, shadow.dev/watchdog) the main process pings
WATCHDOG=1 each half interval from the loops that work, never from a timer:
while parked from its wait for the lock (the flock waits in a thread; the
lock taken, the wake goes on without waiting for a ping), while serving
from the serving loop, as long as the worker that runs the model is not
stuck in one step for half an interval (jobs.py). In a TP group it pings
only while every rank beats (tp.py, heartbeat.py). A stuck step, or a rank
stuck in a kernel or a collective, stops the pings and the runtime ends the
engine. SHADOW_TEST_HANG=1 adds POST /test/hang for tests: it answers, then
has the worker start a GPU kernel that never ends and wait for it
(``{"rank": r}``: on rank r of a group instead, which stops beating).

Environment: SHADOW_ENGINE_ID, SHADOW_LOCK_PATH, NOTIFY_SOCKET,
GMS_SOCKET_DIR, LISTEN_FDS/LISTEN_PID/LISTEN_FDNAMES (as the shim sets
them); ENGINE_PORT (default 8000),
ENGINE_SEED, ENGINE_LAYERS, ENGINE_HIDDEN, ENGINE_KV_GIB (the KV pool, per
GPU), ENGINE_DEVICE (cuda, the default, or cpu), GMS_LIB, ENGINE_PREFIX_CACHE=0 and ENGINE_CUDA_GRAPHS=0 (for
comparisons: no prefix cache, every step eager),
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

# cuBLAS workspaces of 8 MiB per stream, not the 32 MiB torch gives Hopper,
# set before torch starts cuBLAS: a parked engine keeps one per stream it
# ever ran a GEMM on (three here: the batch loop's, the graphs' and the
# weights check's), and the parked shadow's budget is 800 MiB. On an
# H200 the serial version of this engine took as long with 8 MiB as with
# 32; the batching one was measured with 8 only.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:2")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "gms", "python"))
from shadow_gms import (CORRUPT_EXIT, FailoverLock, FdStoreError, Gms, Watchdog, WeightsCorrupt,  # noqa: E402
                        accepted_by_runtime, bytes_written, fdstore_fetch, fdstore_inherited, fdstore_remove,
                        fdstore_store, handoff_receive, listen_socket, notify)
from heartbeat import Heartbeat  # noqa: E402
import continuity  # noqa: E402
from continuity import Continuity, Plain, Stream  # noqa: E402
from jobs import KvUnavailable, SerialWorker, Worker  # noqa: E402
from batching import MAX_CTX, Batcher, fd_table_size  # noqa: E402

VOCAB = 32000
HEAD_DIM = 128
DTYPE = torch.bfloat16
# The longest answer (batching.MAX_CTX is the longest sequence).
MAX_TOKENS = 256
# A connection's thread waits this long for the whole request, and the
# serving loop hands out at most this many connections at once (the rest
# wait in the listen backlog).
CLIENT_TIMEOUT_S = 30.0
MAX_CONNECTIONS = 256
# Tests only: POST /test/hang. Never set in production.
TEST_HANG = os.environ.get("SHADOW_TEST_HANG") == "1"
# Where the model runs: "cuda" (GPU 0, weights and KV pool in a CUDA
# gmsd's memory) or "cpu" (weights and KV pool in a host gmsd's memfds,
# `gmsd --device host`): the same engine and the same hand-over, on a
# machine without a GPU. No CUDA graphs and one process (no ENGINE_TP) on
# the CPU.
DEVICES = ("cuda", "cpu")
DEVICE = os.environ.get("ENGINE_DEVICE", "cuda")


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

    def rows(self, x, k_cache, v_cache, blk, off, table, mask, shape):
        """``S * Q`` rows (``shape``: S sequences of Q rows each) at their
        positions: each row's K and V written at (``blk``, ``off``) of the
        paged caches ([blocks, BLOCK, hidden]), then every row attends over
        its sequence's blocks (``table``, [S, blocks]) as ``mask`` ([S, 1,
        Q, L]) allows. No kernel here mixes rows: a row's result is the
        same whatever the others hold."""
        s_, q_ = shape
        h = x.shape[1]
        heads = h // HEAD_DIM
        q, k, v = F.linear(F.rms_norm(x, (h,), self.norm1), self.qkv).split(h, dim=-1)
        k_cache.index_put_((blk, off), k)
        v_cache.index_put_((blk, off), v)
        index = table.reshape(-1)
        length = table.shape[1] * k_cache.shape[1]
        keys = k_cache.index_select(0, index).view(s_, length, heads, HEAD_DIM).transpose(1, 2)
        vals = v_cache.index_select(0, index).view(s_, length, heads, HEAD_DIM).transpose(1, 2)
        q = q.view(s_, q_, heads, HEAD_DIM).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask)
        x = x + F.linear(a.transpose(1, 2).reshape(s_ * q_, h), self.out)
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
        gen = torch.Generator(device=self.embed.device).manual_seed(seed)
        for name, p in self.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]), generator=gen)

    @torch.no_grad()
    def rows(self, tokens, caches, blk, off, table, pos, positions, shape):
        """The next token (greedy) after each of ``S * Q`` rows: ``tokens``
        at positions ``pos``, written into the paged ``caches`` (per layer
        (K, V)) at (``blk``, ``off``), attending over ``table``'s blocks up
        to their own position (``positions``: the attended positions,
        0..L-1). A prompt chunk is one sequence of Q rows, a decode step S
        sequences of one row (batching.py)."""
        s_, q_ = shape
        length = positions.shape[0]
        mask = (positions.view(1, 1, length) <= pos.view(s_, q_, 1)).view(s_, 1, q_, length)
        x = self.embed[tokens]
        for (kc, vc), layer in zip(caches, self.layers):
            x = layer.rows(x, kc, vc, blk, off, table, mask, shape)
        return F.linear(F.rms_norm(x, (self.hidden,), self.norm), self.embed).argmax(-1)


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
    ``generate`` runs the model: a worker (jobs.py: the batch loop) or a
    function ``generate(tokens, max_tokens, step, emit)`` run one request
    at a time. ``heartbeat`` paces the watchdog's pings; ``hang(rank)``
    makes rank ``rank`` of a group hang (SHADOW_TEST_HANG)."""
    worker = generate if isinstance(generate, Worker) else SerialWorker(generate)
    # 2-3. park on the election lock, pinging while parked.
    notify(f"STATUS=parked engine {engine_id}", f"MAINPID={os.getpid()}")
    lock = FailoverLock().acquire(watchdog=heartbeat)
    t_wake = time.perf_counter()
    woke_at = time.time()

    # 4. wake: the weights check is launched (a group also backs every
    # rank's KV cache and checks every shard first), the worker woken (the
    # batch loop asks for the KV pool's lease), then the port taken (the
    # store is fetched once READY=1 is sent, on a thread of its own). The
    # check runs on the GPU while the engine accepts and starts on its
    # first request; nothing is written before it has passed.
    check = verify_or_exit(engine_id, wake, "promoted", figures=False)
    worker.wake(lock.fd)
    wake_ms = (time.perf_counter() - t_wake) * 1e3
    unchecked = [check]
    settle_lock = threading.Lock()
    # Run once the first answer is out (or at the first idle moment): a
    # group's KV growth, whose driver calls compete with the dead
    # context's teardown.
    after_first = []
    # The promoted engine's path from the lock to its first answer, in ms
    # from the lock (logged with the first answer).
    path = {}

    def since_lock():
        return round((time.perf_counter() - t_wake) * 1e3, 3)

    def settle():
        """The weights check's verdict, before the first answer (or at the
        first idle moment): on a mismatch the engine exits (CORRUPT_EXIT)
        without answering."""
        with settle_lock:
            if unchecked:
                check = unchecked[0]
                t0 = time.perf_counter()
                verify_or_exit(engine_id, check.result, "promoted")
                path["verdict_wait_ms"] = round((time.perf_counter() - t0) * 1e3, 3)
                if check.then is not None:
                    after_first.append(check.then)
                unchecked.pop()

    def grow_now():
        while after_first:
            after_first.pop()()

    def before_write(serving):
        settle()
        with settle_lock:
            if "first_answer_ms" in path:
                return
            path["first_answer_ms"] = since_lock()
            # The connection this answer is on: new, or resumed from the store.
            path["first_conn"], path["first_conn_ms"] = serving
            t = takeover
            if t is not None:
                fetch_done(t)
            path.setdefault("fetched_ms", None)
            path.setdefault("fetch_attempts", None)
            log(event="first-answer", engine=engine_id, ms=path["first_answer_ms"], **path)

    def fetch_done(t):
        if t.done_ms is not None:
            path.setdefault("fetched_ms", t.done_ms)
            path.setdefault("fetch_attempts", t.attempts)

    def test_hang(body):
        """SHADOW_TEST_HANG=1 only: answers, then hangs a GPU step of the
        worker (rank 0), or has rank ``rank`` of a group hang."""
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
                worker.run_stuck(hang_step)
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
            max_tokens = max(1, min(int(req.get("max_tokens", 8)), MAX_TOKENS))
            stream = bool(req.get("stream", False))
        except (ValueError, TypeError, AttributeError) as e:
            return Plain(400, {"error": f"bad request: {e}"})
        tokens = tokenize(prompt, max_tokens)
        if stream:
            def run(emit, progress):
                # What the engine before committed is sent first (the
                # writer passes over what the client has): the worker
                # hands only the tokens after it.
                if progress is not None and progress.carried:
                    for t in progress.carried["tokens"]:
                        emit(token_text(t))
                job = worker.submit(tokens, max_tokens, progress)
                try:
                    for t in job.tokens():
                        emit(token_text(t))
                finally:
                    job.cancel()
            return Stream(len(tokens), run, kv=True)
        job = worker.submit(tokens, max_tokens)
        try:
            out = list(job.tokens())
        except KvUnavailable as e:
            return Plain(503, {"error": f"KV cache: {e}"})
        finally:
            job.cancel()
        text = "".join(token_text(t) for t in out)
        return Plain(200, {"id": head["id"], "object": "text_completion", "created": head["created"],
                           "model": continuity.MODEL, "engine": engine_id, "pid": os.getpid(),
                           "choices": [{"index": 0, "text": text, "tokens": out, "finish_reason": "length"}],
                           "usage": {"prompt_tokens": len(tokens), "completion_tokens": len(out),
                                     "total_tokens": len(tokens) + len(out),
                                     "prompt_tokens_details": {"cached_tokens": job.cached}}})

    cont = Continuity(answer, fdstore_store, fdstore_remove, bytes_written, enabled=store_enabled(), log=log)
    # A client that stalls in the middle of its request loses it after a
    # while: each connection has a thread, and the pinging loop never waits
    # on one.
    client_timeout = CLIENT_TIMEOUT_S
    server = listening(port, inherited)
    # Handed its connections (the runtime accepts): `server` is the
    # hand-off socket, and the fetch once active is what makes them go here.
    handed = inherited is not None and accepted_by_runtime()
    port = port if handed else server.getsockname()[1]
    promote_ms = (time.perf_counter() - t_wake) * 1e3
    active = [0]
    active_lock = threading.Lock()

    def on_thread(conn, serving, resumed, done=None):
        """One connection on a thread of its own: answered (or resumed) and
        finished there; then ``done()``."""
        def run():
            conn.sock.settimeout(client_timeout)
            try:
                if resumed:
                    cont.resume(conn, timeout=client_timeout, before=lambda: before_write(serving))
                else:
                    cont.serve(conn, timeout=client_timeout, before=lambda: before_write(serving))
            finally:
                if resumed:
                    worker.unpin(conn.name)
                with active_lock:
                    active[0] -= 1
                if done is not None:
                    done()
        with active_lock:
            active[0] += 1
        threading.Thread(target=run, name="conn", daemon=True).start()

    # 5. ready.
    notify("READY=1", f"STATUS=active engine {engine_id}", f"MAINPID={os.getpid()}")
    path["ready_ms"] = since_lock()
    log(event="active", engine=engine_id, pid=os.getpid(), woke_at=woke_at,
        wake_ms=round(wake_ms, 3), kv_bytes=kv.nbytes, promote_ms=round(promote_ms, 3), port=port,
        socket="handed" if handed else "inherited" if inherited is not None else "own", fdstore=cont.enabled)
    # What the dead engine was answering: fetched after READY=1 (which then
    # never waits on the runtime's answer), on a thread, while new
    # connections are served; each resumed on a thread of its own once in.
    takeover = Takeover(engine_id, t_wake) if cont.enabled else None
    if takeover is None:
        worker.carried_done()

    def resume_fetched():
        nonlocal takeover
        fetched = takeover.take()
        if fetched is None:
            return
        fetch_done(takeover)
        takeover = None
        conns = cont.take_over(fetched)
        # Every carried stream's blocks are pinned before the worker may
        # evict or reuse anything it finds in the pool.
        for conn in conns:
            if conn.state is not None:
                worker.pin(conn.name, continuity.read_kv(conn.state.fd))
        worker.carried_done()
        left, t0 = [len(conns)], time.perf_counter()
        left_lock = threading.Lock()

        def one_done():
            with left_lock:
                left[0] -= 1
                if left[0] == 0:
                    log(event="resumed", engine=engine_id, connections=len(conns),
                        ms=round((time.perf_counter() - t0) * 1e3, 3), **cont.stats)
        for conn in conns:
            on_thread(conn, ("resumed", since_lock()), True, one_done)

    try:
        # The serving loop: it accepts, hands each connection to a thread,
        # and pings while the worker makes progress (a step stuck for half
        # an interval stops the pings).
        stuck_s = heartbeat.watchdog.interval / 2 if heartbeat.enabled else None
        while True:
            # At MAX_CONNECTIONS the next ones wait in the backlog.
            waiting = [server] if active[0] < MAX_CONNECTIONS else []
            if takeover is not None:
                waiting.insert(0, takeover)
            if unchecked and not select.select(waiting, [], [], 0)[0]:
                settle()  # nobody waiting: the check's verdict now
                grow_now()
            wait = heartbeat.wait()
            if server not in waiting:
                wait = 0.05 if wait is None else min(wait, 0.05)
            ready = select.select(waiting, [], [], wait)[0]
            if takeover is not None and takeover in ready:
                resume_fetched()
            elif server in ready:
                conn = next_connection(server, handed, cont)
                if conn is not None:
                    on_thread(conn, ("new", since_lock()), False)
            grow_now()
            if stuck_s is None or not worker.stalled(stuck_s):
                heartbeat.ping()
    finally:
        lock.release()


def tokenize(prompt, max_tokens):
    """The prompt's tokens (its bytes), keeping the end of one too long to
    leave room for the answer within MAX_CTX."""
    tokens = [b % VOCAB for b in prompt.encode()] or [0]
    return tokens[-(MAX_CTX - max_tokens):]


def token_text(t):
    return chr(32 + t % 95)


def main():
    engine_id = os.environ.get("SHADOW_ENGINE_ID", "0")
    port = int(os.environ.get("ENGINE_PORT", "8000"))
    seed = int(os.environ.get("ENGINE_SEED", "1234"))
    layers = int(os.environ.get("ENGINE_LAYERS", "8"))
    hidden = int(os.environ.get("ENGINE_HIDDEN", "4096"))
    kv_bytes = int(float(os.environ.get("ENGINE_KV_GIB", "8")) * (1 << 30))
    tp = int(os.environ.get("ENGINE_TP", "1"))
    if DEVICE not in DEVICES or (DEVICE == "cpu" and tp > 1):
        # A configuration error: the runtime's restart cannot mend it.
        log(event="config-error", engine=engine_id,
            error=f"ENGINE_DEVICE={DEVICE!r} with ENGINE_TP={tp}: the device is one of {DEVICES}, "
                  f"and a CPU engine is one process (ENGINE_TP=1)")
        sys.exit(2)
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
        worker = generate
    else:
        kv, wake = one_device(engine_id, layers, hidden, seed, kv_bytes, t_start)
        worker, hang = kv, None
    serve(engine_id, port, inherited, kv, wake, worker, heartbeat, hang)


def hang_step():
    """SHADOW_TEST_HANG's stuck step: on the GPU a kernel that never ends
    (2**62 clock cycles) and a host that waits for it (tp.py has the
    ranks' copy); on the CPU a step that never returns."""
    if DEVICE == "cuda":
        torch.cuda._sleep(2 ** 62)
        torch.cuda.synchronize()
    else:
        threading.Event().wait()


def one_device(engine_id, layers, hidden, seed, kv_bytes, t_start):
    """TP=1: the model, its weights through GMS, and the batch loop with
    its graphs captured over the KV pool's reserved addresses (on the
    GPU; on the CPU, DEVICE "cpu", everything runs eagerly); returns
    (batcher, wake)."""
    # 1. initialise: weights through GMS (rw_or_ro).
    cuda = DEVICE == "cuda"
    gms = Gms(mode="rw_or_ro", client=f"torch-engine-{engine_id}", timeout_s=300,
              device=0 if cuda else "host")
    t0 = time.perf_counter()
    if gms.lease == "rw":
        if cuda:
            # Made in GMS memory directly (torch's allocator pointed there).
            with gms.weights_pool():
                model = Model(layers, hidden, "cuda")
                model.init_from_seed(seed)
            generation = gms.commit_module(model)
        else:
            # Host memory has no allocator to point: made, then copied in.
            model = Model(layers, hidden, "cpu")
            model.init_from_seed(seed)
            generation = gms.publish_module(model)
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

    # Attention by the memory-efficient kernel only: the backend torch
    # picks by default on an H200 gave different tokens for the same
    # request run twice (measured with torch 2.11: the first difference
    # came 46 to 158 tokens in), and an engine whose answers must match an
    # undisturbed run's needs one kernel that gives the same bits.
    if cuda:
        torch.backends.cuda.enable_cudnn_sdp(False)
        torch.backends.cuda.enable_flash_sdp(False)
        torch.backends.cuda.enable_math_sdp(False)
        torch.backends.cuda.enable_mem_efficient_sdp(True)
    # The batch loop: every shape warmed up on scratch memory, the prompt
    # chunk and the decode step captured over the KV pool's addresses
    # (reserved, not mapped).
    batcher = Batcher(engine_id, gms, model, layers, hidden, kv_bytes, log)
    batcher.prepare()
    # The promotion's weights check, recorded as one CUDA graph.
    gms.prepare_verify_weights(capture=True)
    # A parked engine holds what it needs and no cached leftovers.
    if cuda:
        torch.cuda.empty_cache()
    log(event="parked", engine=engine_id, pid=os.getpid(), device=DEVICE, kv_addr=hex(batcher.addr),
        kv_bytes=batcher.nbytes, kv_placed=batcher.placed, init_s=round(time.perf_counter() - t_start, 3),
        fd_table=fd_table_size(), torch_reserved_mib=(torch.cuda.memory_reserved() >> 20) if cuda else None)

    def wake():
        """Launches the weights check on the GPU; returns it. Its verdict
        is taken before the first answer."""
        t0 = time.perf_counter()
        pending = gms.begin_verify_weights()
        t1 = time.perf_counter()
        return Check(pending, launch_ms=round((t1 - t0) * 1e3, 3))

    return batcher, wake


def emitted(out, emit):
    """Tokens decoded all at once (a TP group): each emitted once they are
    all there."""
    if emit is not None:
        for t in out:
            emit(t)
    return out


if __name__ == "__main__":
    main()
