"""Tensor parallelism for engine.py: ENGINE_TP=N (N > 1) ranks, one per GPU.

The engine is then a process group (docs/engine-contract.md, "Engines made
of several processes"): the main process is rank 0 and the container's
first process; it starts ranks 1..N-1 (this same engine.py with
ENGINE_RANK=r), holds the election lock and speaks sd_notify for the group,
and ends the engine (kills the ranks, exits 1) when any rank dies. Ranks die
with the main process (PR_SET_PDEATHSIG, and their command pipe closing).

Each rank r:
  - opens GMS on GPU r (`gms-<GPU r's UUID>.sock`: one gmsd per GPU) before
    anything else allocates, and loads (rw) or maps (ro) its own shard at
    the same addresses in every engine;
  - initialises the NCCL group while parked (an all-reduce brings the
    communicator up), so a wake never pays for it;
  - reserves its own KV cache (its heads only) and materialises it on wake.

The layers are Megatron-style: q/k/v and the MLP's up projection are split
by output columns (column parallel), the attention output and the MLP's
down projection by input rows (row parallel) and summed with an all-reduce,
so every forward needs every rank's shard. The embedding and the norms are
replicated. Commands (wake, generate) reach the ranks over their stdin as
JSON lines, never through a collective, so a parked group spins nothing on
its GPUs. NCCL's NVLink multicast stays off (NCCL_NVLS_ENABLE=0).

With a watchdog (WATCHDOG_USEC) only the main process pings, and only
while every rank beats: each rank prints a ``rank-beat`` line on its
stdout at least every ENGINE_BEAT_S seconds (heartbeat.py), from its
command loop while it waits and from its decode steps while it generates.
A rank stuck in a kernel or a collective stops beating, the main process
stops pinging, and the runtime ends the group. The ranks get neither
WATCHDOG_USEC nor WATCHDOG_PID: only the main process speaks sd_notify.
"""

import ctypes
import json
import math
import os
import queue
import signal
import socket
import subprocess
import sys
import threading

import torch
import torch.distributed as dist
import torch.nn.functional as F

from heartbeat import RankBeat
from shadow_gms import CORRUPT_EXIT, Gms, WeightsCorrupt

VOCAB = 32000
HEAD_DIM = 128
DTYPE = torch.bfloat16
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}


class ShardedLayer(torch.nn.Module):
    def __init__(self, hidden, tp, device):
        super().__init__()
        self.part = hidden // tp  # this rank's heads × HEAD_DIM
        kw = dict(device=device, dtype=DTYPE)
        self.norm1 = torch.nn.Parameter(torch.empty(hidden, **kw))
        self.qkv = torch.nn.Parameter(torch.empty(3 * self.part, hidden, **kw))  # column parallel
        self.out = torch.nn.Parameter(torch.empty(hidden, self.part, **kw))  # row parallel
        self.norm2 = torch.nn.Parameter(torch.empty(hidden, **kw))
        self.up = torch.nn.Parameter(torch.empty(4 * hidden // tp, hidden, **kw))  # column parallel
        self.down = torch.nn.Parameter(torch.empty(hidden, 4 * hidden // tp, **kw))  # row parallel

    def forward(self, x, k_cache, v_cache, pos):
        t, h = x.shape
        heads = self.part // HEAD_DIM
        q, k, v = F.linear(F.rms_norm(x, (h,), self.norm1), self.qkv).split(self.part, dim=-1)
        k_cache[pos:pos + t] = k
        v_cache[pos:pos + t] = v
        keys = k_cache[:pos + t].view(pos + t, heads, HEAD_DIM).transpose(0, 1)
        vals = v_cache[:pos + t].view(pos + t, heads, HEAD_DIM).transpose(0, 1)
        q = q.view(t, heads, HEAD_DIM).transpose(0, 1)
        a = F.scaled_dot_product_attention(q, keys, vals, is_causal=(pos == 0 and t > 1))
        a = F.linear(a.transpose(0, 1).reshape(t, self.part), self.out)
        dist.all_reduce(a)
        x = x + a
        m = F.linear(F.silu(F.linear(F.rms_norm(x, (h,), self.norm2), self.up)), self.down)
        dist.all_reduce(m)
        return x + m


class ShardedModel(torch.nn.Module):
    def __init__(self, layers, hidden, tp, device):
        super().__init__()
        self.hidden, self.part = hidden, hidden // tp
        self.embed = torch.nn.Parameter(torch.empty(VOCAB, hidden, device=device, dtype=DTYPE))
        self.layers = torch.nn.ModuleList(ShardedLayer(hidden, tp, device) for _ in range(layers))
        self.norm = torch.nn.Parameter(torch.empty(hidden, device=device, dtype=DTYPE))

    @torch.no_grad()
    def init_from_seed(self, seed, rank):
        # Replicated parameters from the seed alone; each shard from the seed and its rank.
        shared = torch.Generator(device="cuda").manual_seed(seed)
        own = torch.Generator(device="cuda").manual_seed(seed * 1000 + 1 + rank)
        for name, p in self.named_parameters():
            if "norm" in name:
                p.fill_(1.0)
            else:
                p.normal_(0.0, 1.0 / math.sqrt(p.shape[-1]), generator=shared if name == "embed" else own)

    @torch.no_grad()
    def forward(self, tokens, kv, pos):
        x = self.embed[tokens]
        for i, layer in enumerate(self.layers):
            x = layer(x, kv[i][0], kv[i][1], pos)
        return F.linear(F.rms_norm(x[-1:], (self.hidden,), self.norm), self.embed)

    @torch.no_grad()
    def generate(self, tokens, max_tokens, kv, step=None):
        """Every rank runs this in lockstep (the all-reduces pair up); the
        logits are the same on every rank, so the tokens are too. ``step``
        is called after each decode step (its token read back: the step
        is done on the GPU), for the watchdog."""
        max_seq = kv[0][0].shape[0]
        tokens = tokens[-(max_seq - max_tokens):]
        logits = self.forward(torch.tensor(tokens, device="cuda"), kv, 0)
        out, pos = [], len(tokens)
        for _ in range(max_tokens):
            nxt = int(logits.argmax(-1)[0])
            out.append(nxt)
            if step is not None:
                step()
            logits = self.forward(torch.tensor([nxt], device="cuda"), kv, pos)
            pos += 1
        return out


def kv_views(base, layers, width, max_seq):
    per = max_seq * width
    flat = base[: 2 * layers * per]
    return [(flat[(2 * i) * per:(2 * i + 1) * per].view(max_seq, width),
             flat[(2 * i + 1) * per:(2 * i + 2) * per].view(max_seq, width)) for i in range(layers)]


class Rank:
    """What every rank holds: its GMS lease and shard, the NCCL group, its KV."""

    def __init__(self, rank, tp, engine_id, layers, hidden, seed, kv_bytes):
        assert hidden % (tp * HEAD_DIM) == 0, f"ENGINE_HIDDEN {hidden} must split into {tp} × whole heads"
        torch.cuda.set_device(rank)
        self.layers, self.part = layers, hidden // tp
        # GMS first: its address window before any other large allocation.
        self.gms = Gms(mode="rw_or_ro", client=f"torch-engine-{engine_id}-rank{rank}", device=rank,
                       timeout_s=300)
        if self.gms.lease == "rw":
            with self.gms.weights_pool():
                self.model = ShardedModel(layers, hidden, tp, "cuda")
                self.model.init_from_seed(seed, rank)
            self.gms.commit_module(self.model)
        else:
            self.model = self.gms.load_module(ShardedModel(layers, hidden, tp, "meta"))
            self.gms.verify_weights()  # WeightsCorrupt ends the rank, and so the engine
        self.kv = self.gms.kv_cache(kv_bytes)
        self.max_seq = self.kv.nbytes // (2 * layers * self.part * 2)
        # The NCCL group, up while parked: an all-reduce creates the communicator.
        dist.init_process_group("nccl", rank=rank, world_size=tp, device_id=torch.device("cuda", rank))
        one = torch.ones(1, device="cuda")
        dist.all_reduce(one)
        assert int(one.item()) == tp
        # Warm-up on a scratch cache (kernels, cuBLAS, NCCL's buffers), with
        # every shape a short request meets (engine.py's warm_up says why).
        scratch = torch.empty(2 * layers * 64 * self.part, device="cuda", dtype=DTYPE)
        for n in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32):
            self.model.generate(list(range(1, n + 1)), 4, kv_views(scratch, layers, self.part, 64))
        torch.cuda.synchronize()
        del scratch
        self.caches = None

    def wake(self):
        """KV materialised and this rank's shard checked (raises
        WeightsCorrupt); returns the check's figures."""
        pending = self.gms.begin_verify_weights()
        self.kv.materialise()
        self.caches = kv_views(self.kv.tensor(DTYPE), self.layers, self.part, self.max_seq)
        return pending.result() if pending is not None else None

    def generate(self, tokens, max_tokens, step=None):
        return self.model.generate(tokens, max_tokens, self.caches, step)


def hang_gpu():
    """SHADOW_TEST_HANG's stuck step: a kernel that never ends (2**62 clock
    cycles), and a host that waits for it."""
    torch.cuda._sleep(2 ** 62)
    torch.cuda.synchronize()


def run_rank(engine_path):
    """ENGINE_RANK=r: a rank process, driven by rank 0 over stdin."""
    # Die with the main process (PR_SET_PDEATHSIG = 1).
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)
    rank, tp = int(os.environ["ENGINE_RANK"]), int(os.environ["ENGINE_TP"])
    try:
        r = Rank(rank, tp, os.environ.get("SHADOW_ENGINE_ID", "0"), int(os.environ["ENGINE_LAYERS"]),
                 int(os.environ["ENGINE_HIDDEN"]), int(os.environ["ENGINE_SEED"]),
                 int(os.environ["ENGINE_KV_BYTES"]))
    except WeightsCorrupt as e:
        print(json.dumps({"event": "weights-corrupt", "rank": rank, "error": str(e)}), file=sys.stderr, flush=True)
        os._exit(CORRUPT_EXIT)
    print(json.dumps({"event": "rank-parked", "rank": rank}), flush=True)
    beat = RankBeat(rank, os.environ.get("ENGINE_BEAT_S"))
    commands = queue.Queue()

    def read_commands():
        # Only reads: the beats come from the loop below, which does the work.
        for line in sys.stdin:
            commands.put(json.loads(line))
        commands.put(None)

    threading.Thread(target=read_commands, name="commands", daemon=True).start()
    while True:
        beat()
        try:
            cmd = commands.get(timeout=beat.every)
        except queue.Empty:
            continue
        if cmd is None:
            break
        if cmd["op"] == "wake":
            try:
                checked = r.wake()
            except WeightsCorrupt as e:
                print(json.dumps({"event": "weights-corrupt", "rank": rank, "error": str(e)}), file=sys.stderr,
                      flush=True)
                os._exit(CORRUPT_EXIT)
            # The main process says READY=1 only once every rank said this.
            print(json.dumps({"event": "rank-woke", "rank": rank, "verified": checked}), flush=True)
        elif cmd["op"] == "generate":
            r.generate(cmd["tokens"], cmd["max_tokens"], beat)
        elif cmd["op"] == "hang" and os.environ.get("SHADOW_TEST_HANG") == "1":
            print(json.dumps({"event": "rank-hanging", "rank": rank}), file=sys.stderr, flush=True)
            hang_gpu()
    os._exit(0)  # the main process is gone


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Group:
    """Rank 0 (this process) and ranks 1..N-1 as one engine. ``heartbeat``
    (heartbeat.Heartbeat over N-1 ranks) hears each rank's beats."""

    def __init__(self, tp, engine_path, engine_id, layers, hidden, seed, kv_bytes, log, heartbeat):
        os.environ.update(NO_MULTICAST, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        env = dict(os.environ, ENGINE_TP=str(tp), ENGINE_LAYERS=str(layers), ENGINE_HIDDEN=str(hidden),
                   ENGINE_SEED=str(seed), ENGINE_KV_BYTES=str(kv_bytes))
        # The pair's sockets and the watchdog are the main process's: a rank
        # that pinged would feed the watchdog for the whole group.
        for name in ("LISTEN_FDS", "LISTEN_PID", "WATCHDOG_USEC", "WATCHDOG_PID", "ENGINE_BEAT_S"):
            env.pop(name, None)
        if heartbeat.beat_s is not None:
            env["ENGINE_BEAT_S"] = repr(heartbeat.beat_s)
        self.heartbeat = heartbeat
        self.ranks = [subprocess.Popen([sys.executable, engine_path], env=dict(env, ENGINE_RANK=str(r)),
                                       stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                      for r in range(1, tp)]
        # Each rank's lines other than its beats (rank-parked, rank-woke),
        # None once its stdout closed.
        self._events = [queue.Queue() for _ in self.ranks]
        for i, p in enumerate(self.ranks):
            threading.Thread(target=self._follow, args=(i + 1, p, log), daemon=True).start()
            threading.Thread(target=self._read, args=(i, p), daemon=True).start()
        self.own = Rank(0, tp, engine_id, layers, hidden, seed, kv_bytes)
        for events in self._events:
            if events.get() is None:
                raise RuntimeError("a rank ended before it parked")

    def _read(self, i, proc):
        """Rank i+1's stdout: beats go to the heartbeat, the rest to _events."""
        for line in proc.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("event") == "rank-beat":
                self.heartbeat.advanced(i)
            else:
                self._events[i].put(event)
        self._events[i].put(None)

    def _follow(self, rank, proc, log):
        status = proc.wait()
        log(event="rank-died", rank=rank, status=status)
        for p in self.ranks:
            if p.poll() is None:
                p.kill()
        # A group with a rank missing must not serve; a rank that found its
        # shard changed makes the engine say so (the pair restarts cold).
        os._exit(CORRUPT_EXIT if status == CORRUPT_EXIT else 1)

    def _tell(self, **cmd):
        line = json.dumps(cmd) + "\n"
        for p in self.ranks:
            p.stdin.write(line)
            p.stdin.flush()

    @property
    def kv(self):
        return self.own.kv

    def wake(self):
        """Every rank materialises its KV and checks its shard; returns rank
        0's check figures once every rank has woken (a rank that found its
        shard changed ends the engine with CORRUPT_EXIT instead)."""
        self._tell(op="wake")
        checked = self.own.wake()
        for p, events in zip(self.ranks, self._events):
            if events.get() is None:
                # Ended while waking: _follow ends this process with its status.
                if p.wait() == CORRUPT_EXIT:
                    raise WeightsCorrupt("a rank found its shard of the weights changed", [])
                raise RuntimeError("a rank ended while waking")
        return checked

    def generate(self, tokens, max_tokens, step=None):
        self._tell(op="generate", tokens=tokens, max_tokens=max_tokens)
        return self.own.generate(tokens, max_tokens, step)

    def hang(self, rank):
        """SHADOW_TEST_HANG: rank ``rank`` (1..N-1) starts a kernel that never
        ends and stops beating; this process goes on, and stops pinging."""
        p = self.ranks[rank - 1]
        p.stdin.write(json.dumps({"op": "hang"}) + "\n")
        p.stdin.flush()
