"""The torch engine on one GPU as a batching engine: one thread runs the
model over every request in flight (continuous batching), its KV cache
paged in the pair's KV pool (gmsd's memory: it outlives this engine), a
prefix cache of full blocks, and each prompt chunk and decode batch one
CUDA graph replay captured while parked. A promoted engine takes up the blocks and the
streams the dead one left (docs/engine-contract.md, "Carrying the KV
cache").

Why a module of its own: engine.py is the engine contract's steps and the
HTTP side; this is the model's loop, and paged.py its bookkeeping.

**One shape per token.** Every prompt token is computed in a chunk of
``CHUNK`` rows attending over ``MAX_CTX`` positions, every generated token
in a batch of ``BATCH`` rows attending over ``GRAPH_CTX`` positions (or
``MAX_CTX`` past it), padded rows and masked positions included. A row's
result depends on its own inputs only (no kernel mixes rows), so a
request's tokens are the same whatever else is in the batch, whether its
prefix came from the cache and whether its KV came from a dead engine:
the answers of a failover are byte for byte an undisturbed run's.

**Order of writes** (the commit rule, paged.py and continuity.py): a block
is marked written in the index before work is launched into it; once the
step's tokens are read back (the device is synchronised), each stream's
new token id and then its commit word are written to its state memfd,
full blocks enter the index, and only then is the token handed to the
connection's thread to send.

**The pool's addresses.** The pool is granted only to the lock holder,
but the graphs are captured while parked: the engine reserves the
pool's addresses ahead (``Gms.kv_pool_reserve``, where the pool lives once
one exists) and captures over them; the grant maps the pool there. While
parked and not yet at the pool's address (the pool did not exist), the
engine asks again every second and captures again once it is. A grant
elsewhere (the pool made anew at another engine's addresses) captures
again at the grant, and says so. The grant maps the pool's first
allocation only and libgms the rest while the loop runs: until all is
mapped, paged.Blocks hands out and finds blocks of the mapped part only,
and a carried stream whose blocks lie past it waits.
"""

import os
import queue
import sys
import threading
import time

import torch

import paged
from jobs import Job, KvUnavailable, Worker
from paged import BLOCK_TOKENS as BLOCK
from paged import RESERVED_BLOCKS, SCRATCH_BLOCK, ZERO_BLOCK, Blocks, Index, NoBlocks, block_hash, prompt_hashes

DTYPE = torch.bfloat16
# The longest sequence (prompt and answer); a longer prompt keeps its end.
MAX_CTX = 2048
MAX_BLOCKS = MAX_CTX // BLOCK
# Decode rows per step (padded): every generated token is computed in one.
BATCH = 8
# Prompt rows per chunk (padded): every prompt token is computed in one.
CHUNK = 16
# Positions the decode graph attends over; longer sequences decode eager
# over MAX_CTX (both fixed: see "One shape per token").
GRAPH_CTX = 384
# Prompt chunks per step, at most: a long prompt delays the others'
# next tokens by this much compute, not by its whole prefill.
PREFILL_CHUNKS = 4
# Sequences in flight the launcher's staging holds without growing.
STAGED_SEQUENCES = 256
# ENGINE_PREFIX_CACHE=0: no block is shared by prefix (every prompt is
# computed); ENGINE_CUDA_GRAPHS=0: every step eager (the same shapes, so
# the same tokens). For comparing.
PREFIX_CACHE = os.environ.get("ENGINE_PREFIX_CACHE", "1") != "0"
CUDA_GRAPHS = os.environ.get("ENGINE_CUDA_GRAPHS", "1") != "0"
# The promoted engine's first steps are timed and logged (``first-steps``).
FIRST_STEPS = 8
# How long a promoted engine's loop waits, at most, after the fetched
# streams are pinned, for each of them to be submitted (each is resumed on
# a thread of its own): a step started for the first would leave the others
# a step behind it (a decode step of 8 streams is 4.5 ms on the H200).
GATHER_S = 0.004
# Records of full blocks a promoted engine reads per turn of its loop once
# its first steps are done (paged.Blocks.read_some): about a millisecond.
RECORDS_PER_TURN = 1024
# Ints per row of a launch: token, position, block, offset, then the table.
_ROW = 4 + MAX_BLOCKS


def fd_table_size():
    """This process's descriptor table's size (``FDSize``): libgms grows it
    while the engine is parked, so that the grant's descriptors need no
    growth, which waits for an RCU grace period (15-50 ms), on the
    failover's path. Logged at park and at the grant to show it held."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("FDSize:"):
                    return int(line.split()[1])
    except (OSError, ValueError):
        pass
    return None


def _launch_rows(rows, pad_rows):
    """rows: [(token, pos, block, offset, table)], each table padded with
    the zero block; then rows up to ``pad_rows`` that write the scratch
    block at distinct offsets and read the zero block. One flat list of
    ints."""
    flat = []
    for tok, pos, blk, off, table in rows:
        flat += [tok, pos, blk, off] + table + [ZERO_BLOCK] * (MAX_BLOCKS - len(table))
    for r in range(len(rows), pad_rows):
        flat += [0, r, SCRATCH_BLOCK, r] + [ZERO_BLOCK] * MAX_BLOCKS
    return flat


class Geometry:
    """How the pool is cut: blocks of every layer's K and V of BLOCK
    positions, contiguous."""

    def __init__(self, layers, hidden, pool_bytes):
        self.layers, self.hidden = layers, hidden
        self.block_bytes = layers * 2 * BLOCK * hidden * torch.empty((), dtype=DTYPE).element_size()
        self.blocks = pool_bytes // self.block_bytes
        if self.blocks <= RESERVED_BLOCKS:
            raise ValueError(f"a KV pool of {pool_bytes} bytes holds no block of {self.block_bytes}")
        self.pool_bytes = self.blocks * self.block_bytes

    def caches(self, flat):
        """Per layer (K, V) views [blocks, BLOCK, hidden] of a flat pool."""
        n = self.blocks if flat.numel() * flat.element_size() >= self.pool_bytes else \
            flat.numel() * flat.element_size() // self.block_bytes
        five = flat[: n * self.block_bytes // flat.element_size()].view(n, self.layers, 2, BLOCK, self.hidden)
        return [(five[:, i, 0], five[:, i, 1]) for i in range(self.layers)]

    def block_view(self, flat, block):
        per = self.block_bytes // flat.element_size()
        return flat[block * per:(block + 1) * per]


class Shape:
    """One launch's shape: ``s`` sequences of ``q`` rows each, attending
    over ``ctx`` positions (every table cut to ``ctx // BLOCK`` blocks)."""

    def __init__(self, name, s, q, ctx):
        self.name, self.s, self.q, self.ctx = name, s, q, ctx
        self.rows = s * q


# A prompt chunk: one sequence of CHUNK rows over MAX_CTX positions.
PREFILL = Shape("prefill", 1, CHUNK, MAX_CTX)
# A decode batch: BATCH sequences of one row, over GRAPH_CTX positions, or
# over MAX_CTX once a sequence is past GRAPH_CTX.
DECODE = Shape("decode", BATCH, 1, GRAPH_CTX)
DECODE_LONG = Shape("decode-long", BATCH, 1, MAX_CTX)
SHAPES = (PREFILL, DECODE, DECODE_LONG)
# Each one CUDA graph (captured while parked, in this order); DECODE_LONG
# runs eager. The decode batch first: its attention reads the largest
# tensors (24 MiB per layer's K and V at hidden 4096), and the prompt
# chunk's (16 MiB) are then cut from the blocks it freed in the graphs'
# shared pool. The other order left both sizes in it: the parked engine
# held 34 MiB more (822 MiB on the H200, against 788 before the prompt
# chunk had a graph).
GRAPHED = (DECODE, PREFILL)


def run_shape(model, caches, t, shape, positions):
    """``shape``'s rows (``t``: [rows, _ROW] ints on the device) through
    the model: each row's next token."""
    return model.rows(t[:, 0], caches, t[:, 2], t[:, 3], t[::shape.q, 4:4 + shape.ctx // BLOCK], t[:, 1],
                      positions[:shape.ctx], (shape.s, shape.q))


class Graph:
    """One shape's step as a CUDA graph, with its static input (one flat
    int64 buffer) and output."""

    def __init__(self, shape, device):
        self.shape = shape
        self.static = torch.zeros(shape.rows * _ROW, dtype=torch.long, device=device)
        self.out = torch.zeros(shape.rows, dtype=torch.long, device=device)
        self.graph = None


class Launcher:
    """Runs a step's launches with nothing allocated and one sync: the
    step's rows go to the device in one copy (from pinned memory), each
    launch is a graph replay (or the same shape eagerly), every result is
    gathered on the device and comes back in one copy. A promoted engine's
    first steps run while the driver tears the dead engine's context down,
    when an allocation or a pageable copy waits on the driver: none is on
    this path. ``graphs=False`` (or a CPU ``device``) runs every shape
    eagerly: the same shapes, so the same tokens."""

    def __init__(self, model, device="cuda", graphs=True):
        self.model, self.device = model, device
        self.cuda = device == "cuda"
        self.use_graphs = graphs and self.cuda
        self.positions = torch.arange(MAX_CTX, device=device)
        self.graphs = {s.name: Graph(s, device) for s in GRAPHED} if self.use_graphs else {}
        # One memory pool for every graph: they replay one at a time, on
        # one stream, and each keeps its output outside the pool.
        self.mempool = torch.cuda.graph_pool_handle() if self.use_graphs else None
        self.side = torch.cuda.Stream() if self.use_graphs else None
        self.caches = self.addr = None
        self.cap = 0
        # A step's rows at most, with STAGED_SEQUENCES in flight (engine.py
        # serves 256 connections at once): 330 KiB pinned and as much on
        # the device, so that a promoted engine's first steps grow nothing
        # however many streams it carries.
        self._grow(PREFILL_CHUNKS * CHUNK + STAGED_SEQUENCES)

    def _grow(self, rows):
        """Staging for ``rows`` rows (a step with more sequences in flight
        than ever before grows it: an allocation, then, and only then)."""
        pin = self.cuda
        self.h_in = torch.empty(rows * _ROW, dtype=torch.long, pin_memory=pin)
        self.d_in = torch.empty(rows * _ROW, dtype=torch.long, device=self.device)
        self.d_out = torch.empty(rows, dtype=torch.long, device=self.device)
        self.h_out = torch.empty(rows, dtype=torch.long, pin_memory=pin)
        self.cap = rows

    def sync(self):
        if self.cuda:
            torch.cuda.current_stream().synchronize()

    def warm(self, caches):
        """Every shape run eagerly on this thread (its cuBLAS handle is made
        at its first GEMM, and lazy kernels load) and the graphed ones on
        the capture stream, as torch advises before a capture."""
        with torch.no_grad():
            for shape in SHAPES:
                t = torch.tensor(_launch_rows([], shape.rows), dtype=torch.long, device=self.device)
                for _ in range(2):
                    run_shape(self.model, caches, t.view(shape.rows, _ROW), shape, self.positions)
            if self.use_graphs:
                self.side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(self.side):
                    for shape in GRAPHED:
                        g = self.graphs[shape.name]
                        for _ in range(2):
                            run_shape(self.model, caches, g.static.view(shape.rows, _ROW), shape, self.positions)
                torch.cuda.current_stream().wait_stream(self.side)
        self.sync()

    def capture(self, caches, addr):
        """The graphs over ``caches`` (a pool at ``addr``, mapped or only
        reserved: nothing runs now); the eager shapes use them too."""
        self.caches, self.addr = caches, addr
        if not self.use_graphs:
            return
        for g in self.graphs.values():
            g.graph = None
        for g in self.graphs.values():
            cg = torch.cuda.CUDAGraph()
            with torch.cuda.graph(cg, pool=self.mempool, stream=self.side), torch.no_grad():
                g.out.copy_(run_shape(self.model, caches, g.static.view(g.shape.rows, _ROW), g.shape,
                                      self.positions))
            g.graph = cg
        torch.cuda.synchronize()

    def run(self, launches, times=None):
        """``launches``: [(shape, flat ints of its rows)]. Each launch's
        tokens, one list per launch. ``times`` (a dict) gets the host's
        part (``launch_ms``) and the wait for the device (``sync_ms``)."""
        t0 = time.perf_counter()
        rows = sum(shape.rows for shape, _ in launches)
        if rows > self.cap:
            self._grow(max(rows, 2 * self.cap))
        flat = [v for _, f in launches for v in f]
        n = len(flat)
        self.h_in[:n].copy_(torch.tensor(flat, dtype=torch.long))
        self.d_in[:n].copy_(self.h_in[:n], non_blocking=True)
        at_in = at_out = 0
        with torch.no_grad():
            for shape, _ in launches:
                t = self.d_in[at_in:at_in + shape.rows * _ROW]
                g = self.graphs.get(shape.name)
                if g is not None:
                    g.static.copy_(t)
                    g.graph.replay()
                    res = g.out
                else:
                    res = run_shape(self.model, self.caches, t.view(shape.rows, _ROW), shape, self.positions)
                self.d_out[at_out:at_out + shape.rows].copy_(res)
                at_in, at_out = at_in + shape.rows * _ROW, at_out + shape.rows
        self.h_out[:rows].copy_(self.d_out[:rows], non_blocking=True)
        t1 = time.perf_counter()
        self.sync()
        values = self.h_out[:rows].tolist()
        if times is not None:
            times["launch_ms"] = round((t1 - t0) * 1e3, 3)
            times["sync_ms"] = round((time.perf_counter() - t1) * 1e3, 3)
        out, at = [], 0
        for shape, _ in launches:
            out.append(values[at:at + shape.rows])
            at += shape.rows
        return out


class Seq:
    """One request in the batch: its prompt, what it generated, its blocks
    and how many positions of its KV are written (``kv_len``)."""

    def __init__(self, job, name, need):
        self.job, self.name, self.need = job, name, need
        self.prompt, self.max_tokens = job.prompt, job.max_tokens
        self.p = len(self.prompt)
        self.out, self.blocks, self.hashes = [], [], []
        # The hashes of the prompt's full blocks before its last token (what
        # the prefix cache may hold of it).
        self.prompt_hashes = prompt_hashes(self.prompt, ((self.p - 1) // BLOCK) * BLOCK) if PREFIX_CACHE else []
        self.kv_len = 0
        # Tokens known already (a carried stream computed again): fed
        # instead of the model's, and not handed to the thread again.
        self.forced = []
        self.emit_from = 0
        self.progress = job.progress.clone() if job.progress is not None else None
        self.phase = "prefill"
        self.figures = {}

    def token_at(self, j):
        return self.prompt[j] if j < self.p else self.out[j - self.p]

    def tokens_of_block(self, o):
        return [self.token_at(j) for j in range(o * BLOCK, (o + 1) * BLOCK)]

    def close(self):
        if self.progress is not None:
            self.progress.close()
            self.progress = None


class Batcher(Worker):
    """The batch loop (one thread: the only one that launches work into
    the pool or touches its bookkeeping). Connection threads ``submit``;
    the serving loop sends ``pin``/``unpin``/``carried_done`` for the
    streams a takeover fetched."""

    def __init__(self, engine_id, gms, model, layers, hidden, pool_bytes, log):
        super().__init__("batch-loop")
        self.engine_id, self.gms, self.model, self.log = engine_id, gms, model, log
        self.geo = Geometry(layers, hidden, pool_bytes)
        self.nbytes = self.geo.pool_bytes
        # Where the model runs follows the GMS backend: the GPU for a CUDA
        # gmsd, the CPU for a host one (ENGINE_DEVICE=cpu, engine.py).
        self.device = "cpu" if gms.host else "cuda"
        self.launch = Launcher(model, device=self.device, graphs=CUDA_GRAPHS)
        self.pool = self.flat = self.caches = self.blocks = None
        self.pool_id = None
        # The promoted engine's first steps' figures, from the grant on.
        self.first_steps = None
        self.waiting, self.running = [], []
        self.pins = {}
        # Until when the loop waits for the pinned streams (_gather).
        self.gather_until = None
        self._woken = threading.Event()
        self.figures = {"carried": 0, "from_pool": 0, "computed_again": 0, "copied": 0}

    # -- parked -----------------------------------------------------------
    def prepare(self):
        """Starts the loop's thread and waits until it is ready to park:
        every shape it launches run once on scratch memory, on that very
        thread (torch gives each thread its own cuBLAS handle, made at its
        first GEMM: tens of milliseconds a promoted engine must not pay),
        and the graphs captured over the pool's addresses, reserved
        ahead."""
        self._prepared = threading.Event()
        self._failed = []
        self.start()
        self._prepared.wait()
        if self._failed:
            raise self._failed[0]

    def _prepare(self):
        scratch = torch.zeros(RESERVED_BLOCKS * self.geo.block_bytes // 2, dtype=DTYPE, device=self.device)
        self.launch.warm(self.geo.caches(scratch))
        del scratch
        t0 = time.perf_counter()
        self.addr, self.placed = self.gms.kv_pool_reserve(self.geo.pool_bytes)
        self._capture_reserved()
        self._empty_cache()
        self.log(event="kv-pool-reserved", engine=self.engine_id, addr=hex(self.addr), placed=self.placed,
                 bytes=self.geo.pool_bytes, blocks=self.geo.blocks, ms=round((time.perf_counter() - t0) * 1e3, 3))

    def _capture_reserved(self):
        flat = self.gms.reserved_tensor(self.addr, DTYPE, self.geo.pool_bytes)
        self.launch.capture(self.geo.caches(flat), self.addr)
        self._reserved_flat = flat

    def _empty_cache(self):
        """A parked engine keeps no cached device memory it does not use."""
        if self.device == "cuda":
            torch.cuda.empty_cache()

    def _park(self):
        """Until woken. While the reservation is not at the pool's address
        (no pool existed yet), asks again every second; once it is,
        captures the graphs again over it."""
        while not self._woken.wait(None if self.placed else 1.0):
            try:
                addr, placed = self.gms.kv_pool_reserve(self.geo.pool_bytes)
            except Exception as e:  # noqa: BLE001 (gmsd busy or gone: asked again)
                self.log(event="kv-pool-reserve-failed", engine=self.engine_id, error=str(e))
                continue
            if placed:
                t0 = time.perf_counter()
                self.addr, self.placed = addr, True
                self._capture_reserved()
                self._empty_cache()
                self.log(event="kv-pool-reserved", engine=self.engine_id, addr=hex(addr), placed=True,
                         recaptured_ms=round((time.perf_counter() - t0) * 1e3, 3))

    # -- the serving side -------------------------------------------------
    def wake(self, lock_fd):
        self.lock_fd = lock_fd
        self._woken.set()

    def submit(self, prompt, max_tokens, progress=None):
        job = Job(prompt, max_tokens, progress)
        self.inbox.put(("job", job))
        return job

    def pin(self, name, carried):
        self.inbox.put(("pin", name, carried))

    def unpin(self, name):
        self.inbox.put(("unpin", name))

    def carried_done(self):
        self.inbox.put(("carried_done",))

    # -- the loop ---------------------------------------------------------
    def _main(self):
        try:
            self._prepare()
        except Exception as e:  # noqa: BLE001 (handed to prepare(), which raises it)
            self._failed.append(e)
            self._prepared.set()
            return
        self._prepared.set()
        self._park()
        try:
            self._grant()
            while True:
                self._take_messages()
                if self._mapping():
                    self._track_mapping()
                if self.blocks.unread and (self.first_steps is None or not (self.waiting or self.running)):
                    self._read_records()
                if not self.blocks.fenced and self.pool is not None and self.pool.fenced(0):
                    self.blocks.fence_passed()
                    self.log(event="kv-fence", engine=self.engine_id,
                             ms=round((time.perf_counter() - self.t_grant) * 1e3, 3))
                if self.waiting or self.running:
                    self.stepping()
                    self._step()
        except Exception as e:  # noqa: BLE001 (a step that failed: the engine cannot serve on)
            # A CUDA error leaves the context unusable, and a request
            # waits on this loop: the engine ends, and the runtime fails
            # over to the shadow.
            self.log(event="batch-loop-failed", engine=self.engine_id, error=repr(e))
            sys.stdout.flush()
            os._exit(70)

    def _take_messages(self):
        """Everything in the inbox; waits for one while there is nothing to
        do (a little while only, as long as the fence is still to pass or
        the pool still being mapped; a millisecond while the only sequences
        wait for the mapping)."""
        if self.running or (self.waiting and not self._mapping()):
            wait = False
        else:
            self._first_steps_done()
            self.idle()
            wait = True
        settled = self.blocks.fenced and not self._mapping()
        timeout = (0 if self.blocks.unread else 0.001 if self.waiting else None if settled else 0.01)
        while True:
            try:
                if wait:
                    msg = self.inbox.get(timeout=timeout)
                    wait = False
                else:
                    msg = self.inbox.get_nowait()
            except queue.Empty:
                break
            self._message(msg)
        if self.gather_until is not None:
            self._gather()

    def _gather(self):
        """Right after the takeover, waits (until ``gather_until``) for
        every stream pinned for the taking up to be submitted, so that the
        cut streams go on together in the first step instead of a step
        behind the one that came first."""
        t0 = time.perf_counter()
        while True:
            waiting = {s.name for s in self.waiting}
            missing = [name for name, pinned in self.pins.items() if pinned and name not in waiting]
            left = self.gather_until - time.perf_counter()
            if not missing or left <= 0:
                break
            try:
                self._message(self.inbox.get(timeout=left))
            except queue.Empty:
                break
        self.gather_until = None
        self.log(event="carried-gathered", engine=self.engine_id, waited_ms=round((time.perf_counter() - t0) * 1e3, 3),
                 streams=len(self.waiting), missing=len(missing))

    def _message(self, msg):
        kind = msg[0]
        if kind == "job":
            job = msg[1]
            name = getattr(job.progress, "name", None) if job.progress is not None else None
            need = -(-(len(job.prompt) + job.max_tokens) // BLOCK) + 1
            if need > self.geo.blocks - RESERVED_BLOCKS:
                job.end(KvUnavailable(f"{len(job.prompt)} + {job.max_tokens} tokens need {need} KV blocks, "
                                      f"the pool has {self.geo.blocks - RESERVED_BLOCKS}"))
                return
            self.waiting.append(Seq(job, name, need))
        elif kind == "call":
            self.stepping()
            msg[1]()
        elif kind == "pin":
            _, name, carried = msg
            self.pins[name] = self._pin(carried)
        elif kind == "unpin":
            pinned = self.pins.pop(msg[1], None)
            if pinned:
                self.blocks.unpin(pinned)
        elif kind == "carried_done":
            self.blocks.carried_done()
            if any(self.pins.values()):
                self.gather_until = time.perf_counter() + GATHER_S

    def _pin(self, carried):
        """A fetched stream's blocks, pinned until it is taken up; None when
        they cannot be read (another pool, freed, or nothing committed)."""
        if not carried or carried["pool"] != self.pool_id or carried["committed"] == 0:
            return None
        kv_len = carried["prompt"] + carried["committed"] - 1
        blocks = carried["blocks"][:-(-kv_len // BLOCK)]
        return blocks if self.blocks.pin(blocks) else None

    # -- the grant ----------------------------------------------------------
    def _grant(self):
        t0 = time.perf_counter()
        how, why = None, None
        try:
            # Only the pool's first allocation before the first step (the
            # scratch and zero blocks are there): libgms maps the rest
            # while this engine serves.
            pool = self.gms.kv_pool(self.lock_fd, self.geo.pool_bytes, paged.index_bytes(self.geo.blocks),
                                    first_bytes=RESERVED_BLOCKS * self.geo.block_bytes)
            if pool.nbytes < self.geo.pool_bytes or pool.index_bytes < paged.index_bytes(self.geo.blocks):
                pool.close()
                raise ValueError(f"the pair's KV pool is {pool.nbytes} bytes with an index of {pool.index_bytes}: "
                                 f"not this engine's geometry ({self.geo.pool_bytes}, "
                                 f"{paged.index_bytes(self.geo.blocks)}; ENGINE_KV_GIB differs?)")
        except Exception as e:  # noqa: BLE001 (served from a private cache instead, and said so)
            pool, why = None, str(e)
        self.t_grant = time.perf_counter()
        self.first_steps = []
        grant_ms = round((self.t_grant - t0) * 1e3, 3)
        recaptured = None
        parts = None
        if pool is not None:
            self.pool, self.pool_id = pool, pool.pool
            parts = pool.grant_ms()
            if pool.addr == self.launch.addr:
                flat = self._reserved_flat
            else:
                flat = pool.tensor(DTYPE)
            index_fd = pool.index_fd
            created, fenced = pool.created, pool.fenced(0)
        else:
            # No pool (a gmsd without --lock, outside a pair): this engine's
            # own memory, carried nowhere.
            flat = torch.empty(self.geo.pool_bytes // 2, dtype=DTYPE, device=self.device)
            index_fd = os.memfd_create("torch-engine-kv-index", os.MFD_CLOEXEC)
            os.ftruncate(index_fd, paged.index_bytes(self.geo.blocks))
            self.pool_id, created, fenced = 0, True, True
        self.flat, self.caches = flat, self.geo.caches(flat)
        if self.launch.addr != flat.data_ptr():
            t1 = time.perf_counter()
            self.launch.capture(self.caches, flat.data_ptr())
            recaptured = round((time.perf_counter() - t1) * 1e3, 3)
        self.blocks = Blocks(Index(index_fd, self.geo.blocks, self.geo.block_bytes, self.pool_id))
        how = self.how = self.blocks.start(created, fenced)
        mapped = pool.mapped() if pool is not None else self.geo.pool_bytes
        if how == "new":
            # Device memory comes uncleared, and a masked position is
            # still multiplied by zero: numbers from now on, over all of
            # it (the pair's first engine: no failover waits on this).
            if mapped < self.geo.pool_bytes:
                mapped = pool.wait_mapped(self.geo.pool_bytes, 120.0)
                if mapped < self.geo.pool_bytes:
                    pool.mapped()  # raises why, if mapping failed
                    raise RuntimeError(f"{mapped} of the KV pool's {self.geo.pool_bytes} bytes mapped after 120 s")
            flat.zero_()
        else:
            # Nobody writes it; zeroed all the same (2 MiB). Both are in
            # stream order before any step: no wait here.
            self.geo.block_view(flat, ZERO_BLOCK).zero_()
        self._set_mapped(mapped)
        self.log(event="kv-pool", engine=self.engine_id, how=how, pool=self.pool_id, grant_ms=grant_ms,
                 grant_parts_ms=parts,
                 mapped_at_grant=pool.mapped_at_grant() if pool is not None else self.geo.pool_bytes,
                 addr=hex(flat.data_ptr()), bytes=self.geo.pool_bytes, blocks=self.geo.blocks,
                 fenced=fenced, graph_recaptured_ms=recaptured, refused=why, fd_table=fd_table_size(),
                 **self.blocks.figures)

    def _read_records(self):
        """The next records of the full blocks the pool held at the grant
        (the prefix cache the engine before left); once all are read, says
        when and what they held."""
        if self.blocks.read_some(RECORDS_PER_TURN) == 0:
            self.log(event="kv-prefix-read", engine=self.engine_id,
                     ms=round((time.perf_counter() - self.t_grant) * 1e3, 3), **self.blocks.figures)

    def _mapping(self):
        """Whether libgms is still mapping the pool (its blocks from
        ``blocks.limit`` on are not usable yet)."""
        return self.blocks.limit is not None

    def _track_mapping(self):
        """How much of the pool libgms has mapped so far: blocks below it
        may be used. Once all of it is, says when. A pool whose rest cannot
        be mapped raises (GmsError, saying why): the engine ends, and the
        runtime fails over."""
        self._set_mapped(self.pool.mapped())

    def _set_mapped(self, mapped):
        """Blocks below ``mapped`` bytes may be used; once that is all of
        the pool, says when (at the grant, if libgms was that quick)."""
        self.blocks.set_mapped(mapped // self.geo.block_bytes)
        if self.blocks.limit is None and self.pool is not None:
            self.log(event="kv-pool-mapped", engine=self.engine_id, bytes=mapped,
                     ms=round((time.perf_counter() - self.t_grant) * 1e3, 3))

    # -- one step -------------------------------------------------------------
    def _step(self):
        t0 = time.perf_counter()
        for seq in [s for s in self.waiting + self.running if s.job.cancelled]:
            self._finish(seq)
        self._admit()
        launches = []
        chunks = 0
        for seq in self.running:
            if seq.phase == "prefill" and chunks < PREFILL_CHUNKS:
                flat, chunk = self._prefill(seq)
                launches.append((PREFILL, flat, "prefill", (seq, chunk)))
                chunks += 1
        decoding = [s for s in self.running if s.phase == "decode"]
        for shape in (DECODE, DECODE_LONG):
            group = [s for s in decoding if (s.kv_len + 1 <= GRAPH_CTX) == (shape is DECODE)]
            for i in range(0, len(group), BATCH):
                part = group[i:i + BATCH]
                launches.append((shape, self._decode(part), "decode", part))
        if not launches:
            return
        times = {} if self.first_steps is not None else None
        results = self.launch.run([(shape, flat) for shape, flat, _, _ in launches], times)
        for (shape, flat, kind, what), values in zip(launches, results):
            if kind == "prefill":
                self._prefilled(*what, values)
            else:
                for seq, t in zip(what, values):
                    self._decoded(seq, t)
        if times is not None:
            self._first_step(t0, launches, times)

    def _first_step(self, t0, launches, times):
        """The figures of one of this engine's first steps after its grant;
        logged at FIRST_STEPS of them or when the loop first goes idle."""
        t1 = time.perf_counter()
        self.first_steps.append(dict(
            times, at_ms=round((t0 - self.t_grant) * 1e3, 3), ms=round((t1 - t0) * 1e3, 3),
            launches="+".join(shape.name for shape, _, _, _ in launches)))
        if len(self.first_steps) >= FIRST_STEPS:
            self._first_steps_done()

    def _first_steps_done(self):
        if self.first_steps:
            self.log(event="first-steps", engine=self.engine_id, how=self.how, steps=self.first_steps)
            self.first_steps = None

    def _admit(self):
        """Waiting sequences, in order, while the pool has their blocks. A
        carried one whose blocks are not mapped yet waits for them, and so
        does one whose cached prefix runs into blocks not mapped yet (the
        others go past them)."""
        for seq in list(self.waiting):
            pinned = self.pins.get(seq.name) if seq.name is not None else None
            if self._mapping() and (not all(self.blocks.mapped(b) for b in pinned) if pinned else
                                    self.blocks.prefix_unmapped(seq.prompt_hashes, seq.prompt)):
                continue
            owed = sum(max(0, s.need - len(s.blocks)) for s in self.running)
            if not self.blocks.has_available(owed + seq.need):
                return
            self.waiting.remove(seq)
            self.running.append(seq)
            carried = seq.progress.carried if seq.progress is not None else None
            if carried and carried["committed"] > 0:
                self.figures["carried"] += 1
                if self._adopt(seq, carried):
                    continue
            self._start(seq, carried)

    def _start(self, seq, carried):
        """A sequence computed from its prompt: the prefix cache's blocks
        first (only whole blocks before its last prompt token), then its
        chunks. A carried one whose KV cannot be taken up feeds its known
        tokens again."""
        hashes = seq.prompt_hashes
        hits = self.blocks.lookup(hashes, seq.prompt) if PREFIX_CACHE else []
        for b in hits:
            self.blocks.share(b)
        seq.blocks, seq.hashes = list(hits), hashes[:len(hits)]
        seq.kv_len = len(hits) * BLOCK
        seq.figures["prefix_hit"] = seq.job.cached = seq.kv_len
        if carried:
            seq.forced = list(carried["tokens"])
            seq.emit_from = len(seq.forced)
            why = self.pins.get(seq.name, "unpinned")
            seq.figures["why"] = ("another pool" if carried["pool"] != self.pool_id else
                                  "its blocks were not readable" if why is None else "not pinned")
            seq.figures["computed_again"] = seq.p + len(seq.forced) - 1 - seq.kv_len
            self.figures["computed_again"] += seq.figures["computed_again"]
            self._unpin(seq)
        if seq.progress is not None:
            seq.progress.begin(self.pool_id, seq.p)
            for i, b in enumerate(seq.blocks):
                seq.progress.block(i, b)

    def _unpin(self, seq):
        pinned = self.pins.pop(seq.name, None) if seq.name is not None else None
        if pinned:
            self.blocks.unpin(pinned)

    def _adopt(self, seq, carried):
        """A stream the dead engine was decoding: its committed blocks taken
        up as they are (a tail the dead engine may still be writing is
        copied to a free block first, unless the fence passed), and it
        goes on from its last committed token. False: it cannot be."""
        pinned = self.pins.get(seq.name)
        if not pinned or carried["prompt"] != seq.p or carried["committed"] > seq.max_tokens:
            return False
        n = carried["committed"]
        kv_len = seq.p + n - 1
        copies = []
        for i, b in enumerate(pinned):
            full = (i + 1) * BLOCK <= kv_len
            if full or self.blocks.writable_in_place(b):
                self.blocks.own_carried(b, full)
                seq.blocks.append(b)
            else:
                nb = self.blocks.take()
                self.geo.block_view(self.flat, nb).copy_(self.geo.block_view(self.flat, b))
                copies.append((i, nb))
                seq.blocks.append(nb)
            if not full:
                # Past the committed positions: what the dead engine wrote
                # for steps it never committed, zeros in an undisturbed run.
                self._zero_from(seq.blocks[-1], kv_len % BLOCK)
        self._unpin(seq)
        if copies:
            # Committed once it is in the pool: then the table names it.
            self.launch.sync()
            for i, nb in copies:
                seq.progress.block(i, nb)
        seq.out = list(carried["tokens"])
        seq.kv_len = kv_len
        seq.emit_from = n
        parent = 0
        for o in range(kv_len // BLOCK):
            parent = block_hash(parent, seq.tokens_of_block(o))
            seq.hashes.append(parent)
        seq.phase = "decode"
        seq.figures.update(from_pool=kv_len, copied=bool(copies), fenced=self.blocks.fenced)
        self.figures["from_pool"] += kv_len
        self.figures["copied"] += len(copies)
        self.log(event="kv-carried", engine=self.engine_id, name=seq.name, committed=n, **seq.figures)
        if n >= seq.max_tokens:
            self._finish(seq)
        return True

    def _take(self):
        """A block to write, zeroed: positions a mask hides hold zeros,
        whatever the block held before."""
        b = self.blocks.take()
        self.geo.block_view(self.flat, b).zero_()
        return b

    def _zero_from(self, block, offset):
        """Zeroes positions ``offset``.. of ``block`` (what a carried tail
        holds past its committed positions)."""
        g = self.geo
        self.geo.block_view(self.flat, block).view(g.layers, 2, BLOCK, g.hidden)[:, :, offset:].zero_()

    def _block_for(self, seq, ordinal):
        if ordinal == len(seq.blocks):
            b = self._take()
            seq.blocks.append(b)
            if seq.progress is not None:
                seq.progress.block(ordinal, b)
        return seq.blocks[ordinal]

    def _prefill(self, seq):
        """The rows of ``seq``'s next prompt chunk (a PREFILL launch), and
        the positions they compute."""
        s = seq.kv_len
        e = min(s + CHUNK, seq.p)
        b = self._block_for(seq, s // BLOCK)
        rows = [(seq.prompt[j], j, b, j % BLOCK, seq.blocks) for j in range(s, e)]
        # Padded rows of a chunk sit after the real ones, at their positions.
        flat = _launch_rows(rows, CHUNK)
        for r in range(e - s, CHUNK):
            flat[r * _ROW + 1] = s + r
        return flat, (s, e)

    def _decode(self, part):
        """The rows of one decode batch (a DECODE or DECODE_LONG launch)."""
        rows = []
        for seq in part:
            j = seq.kv_len
            b = self._block_for(seq, j // BLOCK)
            rows.append((seq.out[-1], j, b, j % BLOCK, seq.blocks))
        return _launch_rows(rows, BATCH)

    # -- after the step's sync: the commits ---------------------------------
    def _prefilled(self, seq, chunk, values):
        s, e = chunk
        seq.kv_len = e
        if e - s == BLOCK:
            self._full(seq, s // BLOCK)
        if e == seq.p:
            seq.phase = "decode"
            self._push(seq, values[e - s - 1])

    def _decoded(self, seq, t):
        seq.kv_len += 1
        if seq.kv_len % BLOCK == 0:
            self._full(seq, seq.kv_len // BLOCK - 1)
        self._push(seq, t)

    def _full(self, seq, o):
        parent = seq.hashes[o - 1] if o > 0 else 0
        toks = seq.tokens_of_block(o)
        h = block_hash(parent, toks)
        seq.hashes.append(h)
        self.blocks.full(seq.blocks[o], h, parent, toks)

    def _push(self, seq, t):
        i = len(seq.out)
        if i < len(seq.forced):
            if t != seq.forced[i]:
                seq.figures["differed"] = seq.figures.get("differed", 0) + 1
            t = seq.forced[i]
        seq.out.append(t)
        if seq.progress is not None:
            seq.progress.commit(len(seq.out), t)
        if len(seq.out) > seq.emit_from:
            seq.job.put(t)
        if len(seq.out) >= seq.max_tokens:
            self._finish(seq)

    def _finish(self, seq):
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        for b in seq.blocks:
            self.blocks.release(b)
        seq.blocks = []
        self._unpin(seq)
        if seq.forced or seq.figures.get("from_pool"):
            self.log(event="kv-stream-done", engine=self.engine_id, name=seq.name, tokens=len(seq.out),
                     **seq.figures)
        seq.close()
        seq.job.end()


__all__ = ["Batcher", "NoBlocks", "MAX_CTX"]
