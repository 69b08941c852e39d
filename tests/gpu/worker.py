#!/usr/bin/env python3
"""A torch engine-side process for the GPU tests, driven by run.py.

  worker.py writer [--mode rw_or_ro] [--exit-before-commit | --hold-before-commit]
  worker.py reader            map the committed layout read-only, report
  worker.py reader-write      map read-only, then try to write into a weight
  worker.py verify            recompute the weights digest, report verified/corrupt
  worker.py scribble --tensor NAME
                              the CUDA attack: map read-only, make the mapping
                              read-write (cuMemSetAccess), negate one tensor
  worker.py measure --kv-gib N   attach timing of whatever is committed + KV
  worker.py hog --leave-gib N    hold device memory until N GiB are left free
  worker.py kv-wake --kv-gib N   reserve a KV cache, wake it (it grows as
                              memory allows), report; "wait" reports once
                              all of it is backed, and writes its last byte
  worker.py kv-pool --lock PATH --kv-gib N
                              take the election lock, then the pair's KV pool
                              (showing the locked descriptor): report what is
                              in it; a new pool gets a pattern; "spin" queues
                              a second of GPU writes into its last block and
                              reports, to be killed under them; "fence" waits
                              for the fence and reports the last block again

Prints one JSON object per line; after reporting, writer and reader obey
"check" (report again) and "quit" lines on stdin.
"""

import ctypes
import hashlib
import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "gms", "python"))
import torch  # noqa: E402
from shadow_gms import Gms, WeightsCorrupt  # noqa: E402


def say(**fields):
    print(json.dumps(fields), flush=True)


def digest(t):
    return hashlib.sha256(t.contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()


def report(event, tensors):
    torch.cuda.synchronize()
    say(event=event, pid=os.getpid(),
        ptrs={k: t.data_ptr() for k, t in tensors.items()},
        sums={k: digest(t) for k, t in tensors.items()},
        dtypes={k: str(t.dtype) for k, t in tensors.items()})


def serve_checks(tensors):
    for line in sys.stdin:
        if line.strip() == "check":
            report("check", tensors)
        elif line.strip() == "quit":
            break


def known_tensors():
    """Values anyone can recompute: the writer fills, readers compare."""
    n = 16 << 20
    return {
        "a": torch.arange(n, dtype=torch.float32, device="cuda") * 3 + 1,
        "b": (torch.arange(1 << 20, device="cuda") % 251).to(torch.bfloat16).reshape(1024, 1024),
        "c": torch.full((1000,), 7, dtype=torch.int64, device="cuda"),
        "d": torch.arange(4096 * 64, dtype=torch.float16, device="cuda").reshape(4096, 64).t(),
    }


def writer(args):
    mode = args[args.index("--mode") + 1] if "--mode" in args else "rw_or_ro"
    gms = Gms(mode=mode, client="gpu-test-writer", timeout_s=30)
    say(event="lease", lease=gms.lease, pid=os.getpid())
    if gms.lease != "rw":
        tensors = gms.tensors()
        report("mapped", tensors)
        serve_checks(tensors)
        return 0
    with gms.weights_pool():
        tensors = known_tensors()
    torch.cuda.synchronize()
    say(event="filled", pid=os.getpid(), layout_bytes=sum(a["size"] for a in gms.layout()["allocations"]))
    if "--exit-before-commit" in args:
        os._exit(0)
    if "--hold-before-commit" in args:
        sys.stdin.readline()  # the test SIGKILLs us here
        return 1
    generation = gms.commit_tensors(tensors)
    say(event="generation", generation=generation)
    report("committed", tensors)
    serve_checks(tensors)
    return 0


def reader(args):
    gms = Gms(mode="ro", client="gpu-test-reader", timeout_s=30)
    tensors = gms.tensors()
    expect = known_tensors()
    same = all(torch.equal(tensors[k].cpu(), expect[k].cpu()) for k in expect)
    say(event="values", equal_to_recomputed=same)
    report("mapped", tensors)
    serve_checks(tensors)
    return 0


def reader_write(args):
    gms = Gms(mode="ro", client="gpu-test-reader-write", timeout_s=30)
    tensors = gms.tensors()
    report("mapped", tensors)
    try:
        tensors["a"].add_(1.0)
        torch.cuda.synchronize()
    except Exception as e:  # the expected outcome: a CUDA error in this process only
        say(event="write_failed", error=str(e).splitlines()[0][:300])
        os._exit(3)  # the context is poisoned: leave without running destructors
    say(event="write_succeeded")
    return 0


def verify(args):
    gms = Gms(mode="ro", client="gpu-test-verify", timeout_s=30)
    try:
        figures = gms.verify_weights()
    except WeightsCorrupt as e:
        say(event="corrupt", error=str(e), allocations=e.allocations)
        return 0
    say(event="verified", **(figures or {"checked": False}))
    return 0


class _Location(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _AccessDesc(ctypes.Structure):
    _fields_ = [("location", _Location), ("flags", ctypes.c_int)]


CU_MEM_LOCATION_TYPE_DEVICE = 1
CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3


def scribble(args):
    """What a hostile engine can do on CUDA: its read-only mapping of an
    imported handle is its own to change, so it asks for read-write and
    writes the weights every engine of the pair maps."""
    name = args[args.index("--tensor") + 1]
    gms = Gms(mode="ro", client="gpu-test-scribble", timeout_s=30)
    t = gms.tensors()[name]
    alloc = next(a for a in gms.layout()["allocations"] if a["va"] <= t.data_ptr() < a["va"] + a["size"])
    cuda = ctypes.CDLL("libcuda.so.1")
    cuda.cuMemSetAccess.argtypes = [ctypes.c_uint64, ctypes.c_size_t, ctypes.POINTER(_AccessDesc), ctypes.c_size_t]
    desc = _AccessDesc(_Location(CU_MEM_LOCATION_TYPE_DEVICE, gms.device), CU_MEM_ACCESS_FLAGS_PROT_READWRITE)
    rc = cuda.cuMemSetAccess(alloc["va"], alloc["size"], ctypes.byref(desc), 1)
    if rc != 0:
        say(event="scribble_refused", rc=rc, tensor=name)
        return 0
    before = digest(t)
    t.neg_()
    torch.cuda.synchronize()
    say(event="scribbled", tensor=name, allocation=alloc["id"], changed=digest(t) != before)
    return 0


def measure(args):
    kv_gib = float(args[args.index("--kv-gib") + 1]) if "--kv-gib" in args else 64
    t = time.perf_counter()
    gms = Gms(mode="ro", client="gpu-test-measure", timeout_s=30)
    connect_ms = (time.perf_counter() - t) * 1e3
    t = time.perf_counter()
    n = gms.import_layout()
    import_ms = (time.perf_counter() - t) * 1e3
    layout = gms.layout()
    kv = gms.kv_cache(int(kv_gib * (1 << 30)))
    t = time.perf_counter()
    kv.materialise()
    kv_ms = (time.perf_counter() - t) * 1e3
    view = kv.tensor(torch.uint8)
    view[-1] = 1  # the pages are usable from torch
    torch.cuda.synchronize()
    t = time.perf_counter()
    kv.release()
    release_ms = (time.perf_counter() - t) * 1e3
    say(event="measure", allocations=n, bytes=sum(a["size"] for a in layout["allocations"]),
        connect_ms=round(connect_ms, 2), import_map_ms=round(import_ms, 3),
        kv_bytes=kv.nbytes, kv_materialise_ms=round(kv_ms, 3), kv_release_ms=round(release_ms, 3))
    return 0


def hog(args):
    """Another process's memory: what a dead engine holds until the driver
    has torn it down."""
    leave = float(args[args.index("--leave-gib") + 1])
    held = []
    free, _ = torch.cuda.mem_get_info()
    while free > leave * (1 << 30) + (256 << 20):
        n = min(1 << 30, int(free - leave * (1 << 30)))
        held.append(torch.empty(max(n, 1 << 20), dtype=torch.uint8, device="cuda"))
        free, _ = torch.cuda.mem_get_info()
    say(event="hogging", pid=os.getpid(), held_bytes=sum(t.numel() for t in held), free_bytes=free)
    for line in sys.stdin:
        if line.strip() == "quit":
            break
    return 0


def kv_wake(args):
    kv_gib = float(args[args.index("--kv-gib") + 1])
    gms = Gms(mode="rw_or_ro", client="gpu-test-kv-wake", timeout_s=30)
    kv = gms.kv_cache(int(kv_gib * (1 << 30)))
    t = time.perf_counter()
    backed = kv.wake(0)
    wake_ms = (time.perf_counter() - t) * 1e3
    # What fits now, backed by libgms's thread.
    kv.wait(1, 5.0)
    time.sleep(0.2)
    say(event="woken", wake_ms=round(wake_ms, 3), backed_at_return=backed, **kv.info())
    for line in sys.stdin:
        if line.strip() == "wait":
            t = time.perf_counter()
            got = kv.wait(kv.nbytes, 30.0)
            waited = (time.perf_counter() - t) * 1e3
            view = kv.tensor(torch.uint8)
            view[-1] = 1  # the last chunk is usable from torch
            torch.cuda.synchronize()
            say(event="grown", waited_ms=round(waited, 3), last_byte=int(view[-1]), got=got, **kv.info())
        elif line.strip() == "quit":
            break
    kv.release()
    return 0


def kv_pool(args):
    import fcntl
    lock = args[args.index("--lock") + 1]
    nbytes = int(float(args[args.index("--kv-gib") + 1]) * (1 << 30))
    # Everything but the lock first, as a parked engine does.
    gms = Gms(mode="rw_or_ro", client="gpu-test-kv-pool", timeout_s=30)
    if gms.lease == "rw":
        gms.commit()  # an empty layout: the next engine is a reader
    torch.zeros(1, device="cuda").add_(1)
    torch.cuda._sleep(1)
    torch.cuda.synchronize()
    say(event="parked", pid=os.getpid())
    fd = os.open(lock, os.O_RDONLY | os.O_CLOEXEC)
    fcntl.flock(fd, fcntl.LOCK_EX)
    locked = time.monotonic()
    t = time.perf_counter()
    pool = gms.kv_pool(fd, nbytes, 1 << 20)
    grant_ms = (time.perf_counter() - t) * 1e3
    granted = time.monotonic()
    fenced_at_grant = pool.fenced()
    head = pool.tensor(torch.int64, shape=(1 << 20,))
    tail = pool.tensor(torch.int64, shape=(1 << 10,), offset=pool.nbytes - (8 << 10))
    if pool.created:
        head.copy_(torch.arange(1 << 20, device="cuda") * 7 + 3)
        tail.zero_()
        torch.cuda.synchronize()
    expect = torch.arange(1 << 20, device="cuda") * 7 + 3
    carried = bool(torch.equal(head, expect))
    tail_at_grant = int(tail[0])
    say(event="granted", pid=os.getpid(), pool=f"{pool.pool:016x}", addr=pool.addr, size=pool.nbytes,
        created=pool.created, carried=carried, fenced=fenced_at_grant, grant_ms=round(grant_ms, 3),
        locked=locked, granted=granted, tail=tail_at_grant)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "spin":
            # Writes queued on the GPU, as a dying engine's kernels are:
            # each one adds 1 to the last block, a second or more of them.
            torch.cuda.synchronize()
            say(event="spinning", tail=int(tail[0]))
            while True:
                torch.cuda._sleep(1 << 20)
                tail.add_(1)
        elif cmd == "fence":
            passed = pool.fenced(30.0)
            at = time.monotonic()
            torch.cuda.synchronize()
            say(event="fence", passed=passed, at=at, tail=int(tail[0]), tail_at_grant=tail_at_grant)
        elif cmd == "quit":
            break
    pool.close()
    return 0


if __name__ == "__main__":
    cmd, rest = sys.argv[1], sys.argv[2:]
    fn = {"writer": writer, "reader": reader, "reader-write": reader_write, "verify": verify,
          "scribble": scribble, "measure": measure, "hog": hog, "kv-wake": kv_wake,
          "kv-pool": kv_pool}[cmd]
    sys.exit(fn(rest))
