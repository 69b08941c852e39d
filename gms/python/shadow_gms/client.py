"""libgms through ctypes, and the torch glue on top of it.

Tensors on a reader are views of GMS memory (no copy, no allocation):
address = the allocation's virtual address + the tensor's offset, with the
shape, stride and dtype the writer recorded. On a CUDA device they are
built through ``__cuda_array_interface__``: every dtype travels as an
unsigned integer of the same width and is reinterpreted with
``Tensor.view(dtype)``, since the interface has no bfloat16. On the host
backend (``Gms(device="host")``: memfds mapped into this process, for CPU
engines) they are CPU tensors over the mapped bytes. Only that step
differs: what is recorded, committed and checked is the same.
"""

import contextlib
import ctypes
import hashlib
import json
import os
import pathlib
import select
import struct
import time

import torch

MODES = {"rw": 0, "ro": 1, "rw_or_ro": 2}
LEASES = {0: "rw", 1: "ro"}
META_PREFIX = "tensor/"
# The weights digest (docs/gms-protocol.md, "Weights digest"): the same
# names as shadow_contract::weights.
DIGEST_KEY = "shadow/weights-digest"
DIGEST_SCHEME = "sum64-2MiB-sha256/v1"
DIGEST_CHUNK = 2 << 20
# Where publish_tensors places each tensor in its allocation: a boundary
# every SIMD load and oneDNN is happy with.
PUBLISH_ALIGN = 256


class GmsError(RuntimeError):
    pass


class WeightsCorrupt(GmsError):
    """The committed weights this process maps differ from the digest their
    writer recorded. An engine of a pair exits with ``CORRUPT_EXIT`` (65):
    the runtime then restarts the pair cold and the weights are loaded
    again."""

    def __init__(self, message, allocations):
        super().__init__(message)
        self.allocations = allocations


class _Plan:
    """What a digest reads: per allocation (by id), views of its words as
    2 MiB chunks (and a shorter tail). Built once per process and layout:
    making a tensor over foreign memory costs far more on the CPU than the
    GPU's sum of it, and a promotion should pay only for the sums."""

    def __init__(self, allocations, tensor_at=None):
        tensor_at = tensor_at or device_tensor
        per = DIGEST_CHUNK // 8
        self.allocations = sorted(allocations, key=lambda a: a["id"])
        self.bytes = sum(a["size"] for a in self.allocations)
        self.views = []
        for a in self.allocations:
            words = a["size"] // 8
            if words * 8 != a["size"]:
                raise GmsError(f"allocation {a['id']} has {a['size']} bytes, not a whole number of words")
            t = tensor_at(a["va"], torch.int64, (words,))
            full = words // per
            views = []
            if full:
                views.append(t[: full * per].view(full, per))
            if words % per:
                views.append(t[full * per:].view(1, -1))
            self.views.append(views)
        # Sums per allocation, in order (empty allocations have none).
        self.counts = [sum(v.shape[0] for v in views) for views in self.views]
        self._graph = self._out = None

    def _sums(self):
        parts = [torch.cat([v.sum(dim=1) for v in views]) for views in self.views if views]
        return torch.cat(parts) if parts else None

    def capture(self):
        """Records the sums as one CUDA graph over the weights' addresses
        (fixed for the process's life), so that a promotion launches the
        check in one replay instead of an op per chunk view: about 1.5 ms
        of the CPU's time on an H200 for 3.3 GiB of weights. The graph
        reads whatever the memory holds when it is replayed. Falls back to
        launching the ops one by one if capture fails."""
        if self._graph is not None or not any(self.views) or not self.views[0][0].is_cuda:
            return
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(side):
                self._sums()  # run once before capture, as torch asks
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=side):
                out = self._sums()
        except RuntimeError:
            return
        finally:
            torch.cuda.current_stream().wait_stream(side)
        self._graph, self._out = graph, out

    def start(self):
        """Queues the sums on the GPU: each chunk's words added modulo 2^64
        (integer sums do not depend on the reduction's order, so every
        process gets the same values). One check at a time per plan: a
        captured graph writes the same output."""
        return _Digests(self)


class _Digests:
    """Digests being computed; ``result()`` waits for the GPU (one transfer
    to the host for all) and hashes: id -> sha256 hex of the allocation's
    chunk sums as little-endian u64."""

    def __init__(self, plan):
        self.plan = plan
        if plan._graph is not None:
            plan._graph.replay()
            self.flat = plan._out
        else:
            self.flat = plan._sums()

    def result(self):
        values = self.flat.tolist() if self.flat is not None else []
        out, at = {}, 0
        for a, n in zip(self.plan.allocations, self.plan.counts):
            # tolist() gives signed values: packed back into the same words.
            raw = struct.pack(f"<{n}q", *values[at:at + n])
            out[str(a["id"])] = hashlib.sha256(raw).hexdigest()
            at += n
        return out


def weights_digests(allocations, tensor_at=None):
    """id -> hex digest of each allocation (``{"id", "va", "size"}`` as a
    layout lists them) in memory this process maps (docs/gms-protocol.md,
    "Weights digest"); ``tensor_at``: ``host_tensor`` for host memory."""
    return _Plan(allocations, tensor_at).start().result()


class PendingCheck:
    """A weights check under way (``Gms.begin_verify_weights``): ``result()``
    waits for it, returns ``{"ms", "bytes", "allocations"}`` or raises
    ``WeightsCorrupt``."""

    def __init__(self, recorded, plan):
        self._t0 = time.perf_counter()
        self._want = recorded
        self._bytes = plan.bytes
        self._digests = plan.start()

    def result(self):
        got = self._digests.result()
        want = self._want
        bad = sorted((set(got) ^ set(want)) | {i for i in got if i in want and got[i] != want[i]})
        if bad:
            raise WeightsCorrupt(
                f"the committed weights changed since their digest was recorded: "
                f"{len(bad)} of {len(want)} allocation(s) differ (ids {bad[:8]})", bad)
        return {"ms": round((time.perf_counter() - self._t0) * 1e3, 3), "bytes": self._bytes,
                "allocations": len(got)}


def find_library():
    """libgms.so: $GMS_LIB, else next to this package (an image copies it
    there), else the newest of .device/, target/release/ and target/debug/
    of the repository this file sits in (a checkout: `make gpu-bundle`
    fills .device/, cargo the others, and the newest build is the one that
    matches the source)."""
    env = os.environ.get("GMS_LIB")
    if env:
        return env
    here = pathlib.Path(__file__).resolve()
    if (here.parent / "libgms.so").exists():
        return str(here.parent / "libgms.so")
    repo = here.parents[3]
    found = [c for c in (repo / ".device" / "libgms.so", repo / "target" / "release" / "libgms.so",
                         repo / "target" / "debug" / "libgms.so") if c.exists()]
    if found:
        return str(max(found, key=lambda c: c.stat().st_mtime))
    raise GmsError("libgms.so not found: set GMS_LIB, or build it (cargo build -p gms-capi; "
                   "make gpu-bundle puts it in .device/)")


HOST = "host"


def host_tensor(ptr, dtype, shape, stride=None):
    """A CPU tensor over memory mapped at ``ptr`` (no copy). The caller
    keeps the mapping alive for as long as the tensor lives (GMS mappings
    live until the lease ends); writing through a view of a committed,
    read-only mapping is SIGSEGV."""
    dtype = dtype if isinstance(dtype, torch.dtype) else getattr(torch, dtype)
    size = torch.empty((), dtype=dtype).element_size()
    shape = [int(n) for n in shape]
    if stride is None:
        stride, acc = [], 1
        for n in reversed(shape):
            stride.append(acc)
            acc *= max(n, 1)
        stride.reverse()
    if any(n == 0 for n in shape):
        return torch.empty(shape, dtype=dtype)
    extent = 1 + sum((n - 1) * st for n, st in zip(shape, stride))
    raw = (ctypes.c_ubyte * (extent * size)).from_address(int(ptr))
    flat = torch.frombuffer(raw, dtype=torch.uint8)
    return flat.view(dtype).as_strided(shape, stride)


def _is_host(device):
    return device == HOST or (isinstance(device, int) and device < 0)


class _KvPoolDesc(ctypes.Structure):
    """gms.h's gms_kv_pool."""
    _fields_ = [("addr", ctypes.c_uint64), ("size", ctypes.c_uint64), ("pool", ctypes.c_uint64),
                ("index_bytes", ctypes.c_uint64), ("created", ctypes.c_int), ("index_fd", ctypes.c_int),
                ("fence_fd", ctypes.c_int)]


def _bind(path):
    lib = ctypes.CDLL(path)
    c = ctypes
    sig = {
        "gms_last_error": (c.c_char_p, []),
        "gms_connect": (c.c_int, [c.c_char_p, c.c_int, c.c_char_p, c.c_int, c.c_int]),
        "gms_lease": (c.c_int, []),
        "gms_granularity": (c.c_uint64, []),
        "gms_allocate": (c.c_void_p, [c.c_uint64, c.c_char_p]),
        "gms_free": (c.c_int, [c.c_void_p]),
        "gms_put_meta": (c.c_int, [c.c_char_p, c.c_char_p]),
        "gms_get_meta": (c.c_int, [c.c_char_p, c.POINTER(c.c_void_p)]),
        "gms_commit": (c.c_int64, []),
        "gms_import": (c.c_int, []),
        "gms_layout_json": (c.c_void_p, []),
        "gms_string_free": (None, [c.c_void_p]),
        "gms_kv_reserve": (c.c_int64, [c.c_uint64, c.POINTER(c.c_uint64)]),
        "gms_kv_materialise": (c.c_int, [c.c_int64]),
        "gms_kv_wake": (c.c_int64, [c.c_int64, c.c_uint64]),
        "gms_kv_backed": (c.c_int64, [c.c_int64]),
        "gms_kv_wait": (c.c_int64, [c.c_int64, c.c_uint64, c.c_uint64]),
        "gms_kv_event_fd": (c.c_int, [c.c_int64]),
        "gms_kv_info_json": (c.c_void_p, [c.c_int64]),
        "gms_kv_release": (c.c_int, [c.c_int64]),
        "gms_kv_pool_open": (c.c_int, [c.c_int, c.c_uint64, c.c_uint64, c.POINTER(_KvPoolDesc)]),
        "gms_kv_pool_close": (c.c_int, []),
        "gms_kv_pool_open_first": (c.c_int, [c.c_int, c.c_uint64, c.c_uint64, c.c_uint64, c.POINTER(_KvPoolDesc)]),
        "gms_kv_pool_mapped": (c.c_int64, []),
        "gms_kv_pool_mapped_at_grant": (c.c_int64, []),
        "gms_kv_pool_wait_mapped": (c.c_int64, [c.c_uint64, c.c_uint64]),
        "gms_kv_pool_grant_us": (c.c_int, [c.POINTER(c.c_uint64), c.POINTER(c.c_uint64)]),
        "gms_kv_pool_reserve": (c.c_int, [c.c_uint64, c.POINTER(c.c_uint64)]),
        "gms_weights_sleep": (c.c_int, [c.c_int]),
        "gms_disconnect": (None, []),
    }
    for name, (res, args) in sig.items():
        fn = getattr(lib, name)
        fn.restype, fn.argtypes = res, args
    return lib


_TYPESTR = {1: "|u1", 2: "<u2", 4: "<u4", 8: "<u8"}


class _DeviceBytes:
    """An object torch.as_tensor can view: device memory we do not own."""

    def __init__(self, ptr, shape, strides_bytes, typestr):
        self.__cuda_array_interface__ = {
            "shape": tuple(shape),
            "strides": tuple(strides_bytes) if strides_bytes is not None else None,
            "typestr": typestr,
            "data": (int(ptr), False),
            "version": 3,
        }


def device_tensor(ptr, dtype, shape, stride=None):
    """A tensor over existing device memory at ``ptr`` (no copy)."""
    dtype = dtype if isinstance(dtype, torch.dtype) else getattr(torch, dtype)
    size = torch.empty((), dtype=dtype).element_size()
    strides_bytes = None if stride is None else [s * size for s in stride]
    raw = torch.as_tensor(_DeviceBytes(ptr, shape, strides_bytes, _TYPESTR[size]), device="cuda")
    return raw.view(dtype)


def reserved_device_tensor(ptr, dtype, nbytes, device=0):
    """A flat tensor over device addresses that may not be mapped yet (the
    KV pool reserved ahead of its grant, ``Gms.kv_pool_reserve``): torch
    is told the device instead of asking the driver where ``ptr`` lives,
    which it cannot say for an address with nothing mapped. Only work
    captured over it (a CUDA graph) may run before the pool is mapped
    there; anything launched now would fault."""
    dtype = dtype if isinstance(dtype, torch.dtype) else getattr(torch, dtype)
    size = torch.empty((), dtype=dtype).element_size()
    storage = torch._C._construct_storage_from_data_pointer(int(ptr), torch.device("cuda", device), int(nbytes))
    return torch.empty(0, dtype=dtype, device=torch.device("cuda", device)).set_(
        storage, 0, (int(nbytes) // size,), (1,))


class KvCache:
    """A KV cache range: addresses now, pages on ``materialise()`` (all at
    once) or ``wake()`` (what fits now, the rest as the device's memory
    comes back). The pages backed are always the first ``backed`` bytes:
    an engine with a block pool uses the blocks that lie there and adds the
    others as it grows (docs/engine-contract.md)."""

    def __init__(self, gms, handle, addr, nbytes):
        self._gms, self.handle, self.addr, self.nbytes = gms, handle, addr, nbytes

    def materialise(self):
        """All of it backed, waiting up to GMS_KV_OOM_WAIT_MS for memory."""
        self._gms._check(self._gms.lib.gms_kv_materialise(self.handle), "gms_kv_materialise")

    def wake(self, min_bytes=0):
        """Starts backing the cache as memory allows and returns once
        ``min_bytes`` are backed (0: at once); a thread of libgms backs the
        rest. Returns the bytes backed."""
        return self._gms._check(self._gms.lib.gms_kv_wake(self.handle, int(min_bytes)), "gms_kv_wake")

    @property
    def backed(self):
        """Bytes backed now, from the start of the range."""
        return self._gms._check(self._gms.lib.gms_kv_backed(self.handle), "gms_kv_backed")

    def wait(self, nbytes, timeout_s):
        """Waits (the GIL released) until ``nbytes`` are backed, the cache
        stops growing, or ``timeout_s`` pass; returns the bytes backed."""
        ms = max(0, int(timeout_s * 1000))
        return self._gms._check(self._gms.lib.gms_kv_wait(self.handle, int(nbytes), ms), "gms_kv_wait")

    def fileno(self):
        """An eventfd readable after each change of the backing (read 8
        bytes to reset it), for selectors; owned by libgms, never closed here."""
        return self._gms._check(self._gms.lib.gms_kv_event_fd(self.handle), "gms_kv_event_fd")

    def info(self):
        """bytes, chunk, backed, growth ("reserved", "growing", "backed",
        "stalled", "failed"), full_after_ms, waited_ms or error."""
        return json.loads(self._gms._take_string(self._gms.lib.gms_kv_info_json(self.handle), "gms_kv_info_json"))

    def release(self):
        self._gms._check(self._gms.lib.gms_kv_release(self.handle), "gms_kv_release")

    def tensor(self, dtype=torch.uint8, shape=None, offset=0):
        """A view of the materialised pages (not zeroed)."""
        dtype = dtype if isinstance(dtype, torch.dtype) else getattr(torch, dtype)
        size = torch.empty((), dtype=dtype).element_size()
        if shape is None:
            shape = ((self.nbytes - offset) // size,)
        return device_tensor(self.addr + offset, dtype, shape)


class KvPool:
    """The pair's KV pool, this engine's to write: gmsd's memory, mapped at
    the address every engine of the pair maps it at, with what the engine
    before this one left in it (``created``: nothing), its index (host
    memory, ``index_fd``: ``os.pread``/``os.pwrite``) and its fence
    (``fence_fd``, readable once every engine that wrote the pool before is
    gone). Until ``fenced()``, write only where none of them could have
    been writing (docs/engine-contract.md, "Carrying the KV cache")."""

    def __init__(self, gms, desc):
        self._gms = gms
        self.addr, self.nbytes, self.pool = desc.addr, desc.size, desc.pool
        self.index_bytes, self.created = desc.index_bytes, bool(desc.created)
        self.index_fd, self.fence_fd = desc.index_fd, desc.fence_fd
        self._fenced = False

    def fenced(self, timeout_s=0.0):
        """Whether every earlier writer is gone, waiting up to ``timeout_s``."""
        if not self._fenced:
            ready, _, _ = select.select([self.fence_fd], [], [], max(0.0, timeout_s))
            self._fenced = bool(ready)
        return self._fenced

    def tensor(self, dtype=torch.uint8, shape=None, offset=0):
        """A view of the pool (device memory for a CUDA daemon)."""
        dtype = dtype if isinstance(dtype, torch.dtype) else getattr(torch, dtype)
        size = torch.empty((), dtype=dtype).element_size()
        if shape is None:
            shape = ((self.nbytes - offset) // size,)
        return self._gms.tensor_at(self.addr + offset, dtype, shape)

    def mapped(self):
        """Bytes of the pool mapped from its start (``nbytes`` once all
        are). Raises GmsError once mapping the rest failed (what is mapped
        stays usable)."""
        return self._gms._check(self._gms.lib.gms_kv_pool_mapped(), "gms_kv_pool_mapped")

    def mapped_at_grant(self):
        """Bytes of the pool mapped before the grant returned (the rest
        libgms maps while the engine goes on)."""
        return self._gms._check(self._gms.lib.gms_kv_pool_mapped_at_grant(), "gms_kv_pool_mapped_at_grant")

    def wait_mapped(self, nbytes, timeout_s):
        """Waits up to ``timeout_s`` for ``nbytes`` of the pool to be
        mapped; the bytes mapped then."""
        return self._gms._check(self._gms.lib.gms_kv_pool_wait_mapped(int(nbytes), int(timeout_s * 1000)),
                                "gms_kv_pool_wait_mapped")

    def grant_ms(self):
        """Where the grant's time went: ``{"answer": gmsd's answer,
        "map": import, map and access}``, in ms."""
        answer, mapped = ctypes.c_uint64(), ctypes.c_uint64()
        self._gms._check(self._gms.lib.gms_kv_pool_grant_us(ctypes.byref(answer), ctypes.byref(mapped)),
                         "gms_kv_pool_grant_us")
        return {"answer": answer.value / 1e3, "map": mapped.value / 1e3}

    def close(self):
        """Gives the write lease back (the pool stays gmsd's)."""
        self._gms._check(self._gms.lib.gms_kv_pool_close(), "gms_kv_pool_close")


class Gms:
    """One process's lease on its GPU's GMS daemon."""

    def __init__(self, mode="rw_or_ro", client="engine", device=0, socket_path=None,
                 timeout_s=60.0, lib_path=None):
        """``device``: a CUDA ordinal, or ``"host"`` for the host backend
        (``$GMS_SOCKET_DIR/gms-host.sock``)."""
        self.lib = _bind(lib_path or find_library())
        self.host = _is_host(device)
        self.device = HOST if self.host else device
        path = socket_path.encode() if socket_path else None
        if not self.host:
            torch.cuda.init()  # primary context first, so torch and libgms share it
        lease = self.lib.gms_connect(path, MODES[mode], client.encode(), -1 if self.host else device,
                                     int(timeout_s * 1000))
        self._check(lease, "gms_connect")
        self.lease = LEASES[lease]
        self._pool = None
        self._allocator = None
        self._check_plan = None  # (recorded digests, _Plan), once read

    # -- plumbing ---------------------------------------------------------
    def _error(self, what):
        msg = self.lib.gms_last_error()
        return GmsError(f"{what}: {msg.decode(errors='replace') if msg else 'unknown error'}")

    def _check(self, ret, what):
        if ret is None or (isinstance(ret, int) and ret < 0):
            raise self._error(what)
        return ret

    def _take_string(self, ptr, what):
        if not ptr:
            raise self._error(what)
        try:
            return ctypes.string_at(ptr).decode()
        finally:
            self.lib.gms_string_free(ptr)

    def close(self):
        self.lib.gms_disconnect()

    def tensor_at(self, ptr, dtype, shape, stride=None):
        """A tensor over GMS memory of this backend at ``ptr`` (no copy):
        with ``reserved_tensor``, what differs between the CUDA and the
        host backend."""
        if self.host:
            return host_tensor(ptr, dtype, shape, stride)
        return device_tensor(ptr, dtype, shape, stride)

    def reserved_tensor(self, ptr, dtype, nbytes):
        """A flat tensor over addresses reserved for the KV pool and maybe
        not mapped yet (``kv_pool_reserve``): nothing may read or write
        it before the pool is mapped there. On CUDA, work captured over it
        (a CUDA graph) may; on the host backend the tensor is only where
        the pool will be."""
        if self.host:
            dtype = dtype if isinstance(dtype, torch.dtype) else getattr(torch, dtype)
            size = torch.empty((), dtype=dtype).element_size()
            return host_tensor(ptr, dtype, (int(nbytes) // size,))
        return reserved_device_tensor(ptr, dtype, nbytes, self.device)

    def _synchronize(self):
        if not self.host:
            torch.cuda.synchronize(self.device)

    # -- layout -----------------------------------------------------------
    def layout(self):
        return json.loads(self._take_string(self.lib.gms_layout_json(), "gms_layout_json"))

    def put_meta(self, key, value):
        self._check(self.lib.gms_put_meta(key.encode(), value.encode()), "gms_put_meta")

    def get_meta(self, key):
        out = ctypes.c_void_p()
        found = self._check(self.lib.gms_get_meta(key.encode(), ctypes.byref(out)), "gms_get_meta")
        return self._take_string(out.value, "gms_get_meta") if found else None

    def import_layout(self):
        n = self._check(self.lib.gms_import(), "gms_import")
        self._imported = True
        return n

    def commit(self):
        generation = self._check(self.lib.gms_commit(), "gms_commit")
        self.lease = "ro"
        self._imported = True  # the writer's own mappings stay, now read-only
        return generation

    # -- writer: weights through a torch MemPool --------------------------
    @contextlib.contextmanager
    def weights_pool(self):
        """Inside this block every CUDA allocation of torch is GMS memory."""
        if self.lease != "rw":
            raise GmsError("weights_pool needs the rw lease (this engine is a reader)")
        if self.host:
            raise GmsError("weights_pool is CUDA's (torch has no pluggable CPU allocator): "
                           "publish_module copies into host memory")
        if self._pool is None:
            self._allocator = torch.cuda.memory.CUDAPluggableAllocator(
                self.lib._name, "gms_torch_malloc", "gms_torch_free")
            self._pool = torch.cuda.MemPool(self._allocator.allocator())
        try:
            with torch.cuda.use_mem_pool(self._pool, device=self.device):
                yield self._pool
        except torch.OutOfMemoryError as e:
            # torch reports any NULL from the allocator as OOM; say why.
            raise self._error(f"allocating weights in GMS ({str(e).splitlines()[0][:120]})") from e

    def tensor_meta(self, tensors, allocations):
        """name -> JSON metadata of each tensor's place in the layout."""
        out = {}
        for name, t in tensors.items():
            ptr = t.data_ptr()
            alloc = next((a for a in allocations if a["va"] <= ptr < a["va"] + a["size"]), None)
            if alloc is None:
                raise GmsError(f"tensor {name} at {ptr:#x} is not in GMS memory "
                               "(allocate it inside weights_pool())")
            out[name] = json.dumps({
                "alloc": alloc["id"], "offset": ptr - alloc["va"], "shape": list(t.shape),
                "stride": list(t.stride()), "dtype": str(t.dtype).removeprefix("torch."),
            })
        return out

    def commit_tensors(self, tensors):
        """Records each tensor's metadata and the weights digest, then
        commits. Returns the generation."""
        self._synchronize()
        allocations = self.layout()["allocations"]
        for name, meta in self.tensor_meta(tensors, allocations).items():
            self.put_meta(META_PREFIX + name, meta)
        plan = _Plan(allocations, self.tensor_at)
        digests = plan.start().result()
        self.put_meta(DIGEST_KEY, json.dumps({
            "scheme": DIGEST_SCHEME, "chunk_bytes": DIGEST_CHUNK, "allocations": digests}))
        generation = self.commit()
        self._check_plan = (digests, plan)
        return generation

    def verify_weights(self):
        """Recomputes the digest of every committed allocation (on the GPU,
        over this process's mappings) and compares it with the one the
        writer recorded at commit.

        Returns ``{"ms", "bytes", "allocations"}``, or None when the layout
        has no digest (its writer recorded none): nothing was checked.
        Raises ``WeightsCorrupt`` on a mismatch. A promoted engine calls it
        after taking the lock and before its first answer."""
        pending = self.begin_verify_weights()
        return pending.result() if pending is not None else None

    def begin_verify_weights(self):
        """``verify_weights`` in two steps: queues the GPU's work and
        returns a ``PendingCheck`` (None when there is no digest), so that
        the check overlaps other work (the KV cache's wake, the first
        request); its ``result()`` must come before the first answer
        leaves the engine."""
        plan = self.prepare_verify_weights()
        if plan is None:
            return None
        recorded, plan = plan
        return PendingCheck(recorded, plan)

    def prepare_verify_weights(self, capture=False):
        """Reads the recorded digest and plans the check once per process
        (None: the layout has no digest); with ``capture``, also records
        the check as a CUDA graph (``_Plan.capture``), which a parked engine
        does so that its promotion launches the check in one replay."""
        if self._check_plan is None:
            # The committed layout cannot change under a lease that holds
            # it, so what it says is read once per process.
            layout = self.layout()
            text = layout["metadata"].get(DIGEST_KEY)
            if text is None:
                return None
            try:
                recorded = json.loads(text)
            except ValueError as e:
                raise WeightsCorrupt(f"the weights digest is not JSON: {e}", []) from e
            if not isinstance(recorded, dict) or not isinstance(recorded.get("allocations"), dict):
                raise WeightsCorrupt("the weights digest is not an object with allocations", [])
            if recorded.get("scheme") != DIGEST_SCHEME or recorded.get("chunk_bytes") != DIGEST_CHUNK:
                raise WeightsCorrupt(f"a weights digest of another scheme: {recorded.get('scheme')!r}", [])
            if self.lease == "ro" and not getattr(self, "_imported", False):
                self.import_layout()
            self._check_plan = (recorded["allocations"], _Plan(layout["allocations"], self.tensor_at))
        if capture:
            self._check_plan[1].capture()
        return self._check_plan

    def commit_module(self, module):
        return self.commit_tensors(dict(_module_tensors(module)))

    # -- writer: weights copied in (any backend) ---------------------------
    def allocate(self, nbytes, tag="weights"):
        """Writer: a new allocation of at least ``nbytes``, mapped read-write;
        returns its address."""
        if self.lease != "rw":
            raise GmsError("allocate needs the rw lease (this engine is a reader)")
        ptr = self.lib.gms_allocate(int(nbytes), tag.encode())
        if not ptr:
            raise self._error(f"allocating {nbytes} bytes of {tag}")
        return ptr

    def publish_tensors(self, tensors, align=PUBLISH_ALIGN):
        """Writer: copies ``tensors`` (name -> tensor, already loaded) into
        one new allocation, each contiguous at an ``align``-byte boundary,
        records them and the weights digest, and commits. Returns
        (generation, name -> view of the committed, now read-only, copy).
        Works on both backends: the copy is the only way onto the host
        backend (torch has no pluggable CPU allocator), and costs a CUDA
        writer a transient second copy of its weights."""
        places, at = {}, 0
        for name, t in tensors.items():
            if t.is_meta:
                raise GmsError(f"tensor {name} has no data (meta device): load it before publishing")
            at = -(-at // align) * align
            places[name] = at
            at += t.numel() * t.element_size()
        base = self.allocate(max(at, 1))
        views = {}
        for name, t in tensors.items():
            view = self.tensor_at(base + places[name], t.dtype, tuple(t.shape))
            view.copy_(t.detach())
            views[name] = view
        generation = self.commit_tensors(views)
        return generation, views

    def publish_module(self, module):
        """Writer: ``publish_tensors`` of every parameter and buffer of
        ``module``, which then uses the committed copy (its own tensors are
        dropped). Returns the generation."""
        generation, views = self.publish_tensors(dict(_module_tensors(module)))
        _bind_module(module, views)
        return generation

    # -- reader: tensors from the committed layout ------------------------
    def tensors(self):
        """name -> tensor, zero-copy views of the committed layout (maps it
        first if this process has not yet)."""
        layout = self.layout()
        if self.lease == "ro" and not getattr(self, "_imported", False):
            self.import_layout()
            self._imported = True
        vas = {a["id"]: a["va"] for a in layout["allocations"]}
        out = {}
        for key, text in layout["metadata"].items():
            if not key.startswith(META_PREFIX):
                continue
            m = json.loads(text)
            out[key[len(META_PREFIX):]] = self.tensor_at(
                vas[m["alloc"]] + m["offset"], m["dtype"], m["shape"], m["stride"])
        return out

    def load_module(self, module):
        """Points every parameter and buffer of ``module`` (built on the
        'meta' device, say) at the committed weights. Nothing is read from
        disk and nothing is copied."""
        tensors = self.tensors()
        missing = [n for n, _ in _module_tensors(module) if n not in tensors]
        if missing:
            raise GmsError(f"committed layout lacks {len(missing)} tensor(s), e.g. {missing[:3]}")
        _bind_module(module, tensors)
        return module

    # -- KV ---------------------------------------------------------------
    def kv_pool(self, proof_fd, nbytes, index_bytes, first_bytes=None):
        """The write lease of the pair's KV pool (a ``KvPool``), showing
        ``proof_fd``: a descriptor through which this engine holds the
        pair's election lock (``FailoverLock.fd``). With ``first_bytes``,
        only the pool's allocations that hold its first ``first_bytes`` are
        mapped when this returns, and libgms maps the rest while the engine
        goes on: use the first ``KvPool.mapped()`` bytes only."""
        desc = _KvPoolDesc()
        if first_bytes is None:
            self._check(self.lib.gms_kv_pool_open(int(proof_fd), int(nbytes), int(index_bytes), ctypes.byref(desc)),
                        "gms_kv_pool_open")
        else:
            self._check(self.lib.gms_kv_pool_open_first(int(proof_fd), int(nbytes), int(index_bytes),
                                                        int(first_bytes), ctypes.byref(desc)),
                        "gms_kv_pool_open_first")
        return KvPool(self, desc)

    def kv_pool_reserve(self, nbytes):
        """Addresses for the pair's KV pool before this engine holds its
        lease (``gms_kv_pool_reserve``): ``(addr, placed)``, ``placed``
        when they are the existing pool's. ``kv_pool`` takes them."""
        addr = ctypes.c_uint64()
        placed = self._check(self.lib.gms_kv_pool_reserve(int(nbytes), ctypes.byref(addr)), "gms_kv_pool_reserve")
        return addr.value, bool(placed)

    def kv_cache(self, nbytes):
        addr = ctypes.c_uint64()
        handle = self._check(self.lib.gms_kv_reserve(nbytes, ctypes.byref(addr)), "gms_kv_reserve")
        gran = self.lib.gms_granularity()
        rounded = -(-nbytes // gran) * gran
        return KvCache(self, handle, addr.value, rounded)


def _bind_module(module, tensors):
    """Points each parameter and buffer of ``module`` at ``tensors[name]``.
    A parameter keeps its class and attributes (vLLM hangs its weight
    loaders and shard dims on them): only its data changes."""
    for name, _ in list(_module_tensors(module)):
        owner_name, _, leaf = name.rpartition(".")
        owner = module.get_submodule(owner_name) if owner_name else module
        t = tensors[name]
        if leaf in owner._parameters:
            old = owner._parameters[leaf]
            if type(old) is torch.nn.Parameter or old is None:
                owner._parameters[leaf] = torch.nn.Parameter(t, requires_grad=False)
            else:
                # A subclass (vLLM's parameters): the same class over the
                # new data, with the old one's attributes. Setting .data
                # instead fails from a 'meta' tensor to a real one.
                new = torch.Tensor._make_subclass(type(old), t, False)
                new.__dict__.update(old.__dict__)
                owner._parameters[leaf] = new
        else:
            owner._buffers[leaf] = t


def _module_tensors(module):
    yield from module.named_parameters(remove_duplicate=True)
    yield from module.named_buffers(remove_duplicate=True)
