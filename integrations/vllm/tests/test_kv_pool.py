"""shadow_gms's KV pool (``Gms.kv_pool``, libgms's ``gms_kv_pool_open``)
against a real gmsd of the host backend, in this venv because the client
needs torch: the engine holding the election lock gets the pool's write
lease by showing its locked descriptor; the next engine, parked on the
lock, gets the same pool with what the first wrote in it, and a fence that
opens once the first is gone; an engine without the lock is refused.

Needs gmsd and libgms.so built (``cargo build -p gmsd -p gms-capi``);
GMSD / GMS_LIB override.
"""

import json
import os
import subprocess
import sys
import tempfile
import textwrap
import unittest

from test_loader import Gmsd, built

# One engine: its Gms lease first (parked work; with "ahead" the pool's
# addresses reserved then), then the lock (unless "none"), then the pool; a pool it made gets a pattern; one line of
# JSON per step; stdin's EOF ends it.
CHILD = textwrap.dedent("""
    import fcntl, json, os, sys, time
    import torch
    from shadow_gms.client import Gms
    lock_path, take, ahead = sys.argv[1], sys.argv[2] == "lock", sys.argv[3] == "ahead"
    first = int(sys.argv[4]) if len(sys.argv) > 4 else None
    gms = Gms(mode="rw_or_ro", client="kv-pool-test", device="host", timeout_s=20)
    if gms.lease == "rw":
        gms.commit()
    reserved = gms.kv_pool_reserve(8 << 20) if ahead else None
    again = gms.kv_pool_reserve(8 << 20) if ahead else None
    print(json.dumps({"event": "parked", "pid": os.getpid(), "reserved": reserved, "again": again}), flush=True)
    fd = os.open(lock_path, os.O_RDONLY | os.O_CLOEXEC)
    if take:
        fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        pool = gms.kv_pool(fd, 8 << 20, 4096, first_bytes=first)
    except Exception as e:
        print(json.dumps({"event": "refused", "error": str(e)}), flush=True)
        sys.exit(0)
    mapped_at_grant = pool.mapped_at_grant()
    mapped = pool.wait_mapped(pool.nbytes, 10.0)
    head = pool.tensor(torch.int64, shape=(1024,))
    tail = pool.tensor(torch.int64, shape=(1024,), offset=pool.nbytes - 8192)
    want = torch.arange(1024, dtype=torch.int64) * 5 + 1
    if pool.created:
        head.copy_(want)
        tail.copy_(want * 3)
    print(json.dumps({"event": "granted", "created": pool.created, "pool": pool.pool, "addr": pool.addr,
                      "carried": bool(torch.equal(head, want)), "index": os.pread(pool.index_fd, 4, 0).hex(),
                      "fenced": pool.fenced(10.0), "grant_ms": pool.grant_ms(), "mapped_at_grant": mapped_at_grant,
                      "mapped": mapped, "size": pool.nbytes, "tail_carried": bool(torch.equal(tail, want * 3))}),
          flush=True)
    if pool.created:
        os.pwrite(pool.index_fd, b"mark", 0)
    sys.stdin.read()
    pool.close()
""")


class KvPoolOverHostGms(unittest.TestCase):
    GMSD_ARGS = []

    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="shadow-kv-pool-")
        self.lock = os.path.join(self.tmp.name, "lock")
        open(self.lock, "w").close()
        self.gmsd = Gmsd(extra=["--lock", self.lock] + self.GMSD_ARGS)
        self.children = []

    def tearDown(self):
        for c in self.children:
            if c.poll() is None:
                c.kill()
            c.wait()
            c.stdout.close()
            if c.stdin and not c.stdin.closed:
                c.stdin.close()
        self.gmsd.stop()
        self.tmp.cleanup()

    def child(self, take=True, ahead=False, first=None):
        c = subprocess.Popen([sys.executable, "-c", CHILD, self.lock, "lock" if take else "none",
                              "ahead" if ahead else "at-grant"] + ([str(first)] if first is not None else []),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=self.gmsd.env())
        self.children.append(c)
        return c

    def event(self, c, name):
        while True:
            line = c.stdout.readline()
            if not line:
                self.fail(f"child exited ({c.wait()}) before {name}")
            got = json.loads(line)
            if got["event"] == name:
                return got

    def test_the_next_lock_holder_gets_the_same_pool_behind_a_fence(self):
        a = self.child()
        first = self.event(a, "granted")
        self.assertTrue(first["created"] and first["carried"] and first["fenced"], first)
        b = self.child()
        self.event(b, "parked")
        stranger = self.child(take=False)
        refused = self.event(stranger, "refused")
        self.assertIn("election lock", refused["error"])
        a.kill()
        second = self.event(b, "granted")
        self.assertFalse(second["created"], second)
        self.assertEqual((second["pool"], second["addr"]), (first["pool"], first["addr"]))
        self.assertTrue(second["carried"], "what the first engine wrote is in the pool")
        self.assertEqual(bytes.fromhex(second["index"]), b"mark", "and in its index")
        self.assertTrue(second["fenced"], "the fence opened once the first was gone")
        # The grant says where its time went (gmsd's answer, the mapping).
        self.assertEqual(set(second["grant_ms"]), {"answer", "map"})
        self.assertTrue(all(v >= 0 for v in second["grant_ms"].values()), second["grant_ms"])

    def test_addresses_reserved_ahead_are_where_the_pool_is_granted(self):
        """A parked engine reserves the pool's addresses before it holds
        the lease (to capture work over them): the first, with no pool yet,
        gets the pool made at its own reservation; the next, while the pool
        exists, reserves exactly the pool's addresses and is granted the
        pool there."""
        a = self.child(ahead=True)
        parked_a = self.event(a, "parked")
        addr_a, placed_a = parked_a["reserved"]
        self.assertFalse(placed_a, "no pool exists before the first grant")
        self.assertEqual(parked_a["again"], parked_a["reserved"],
                         "asked again with no pool, the reservation stays where work was captured over it")
        first = self.event(a, "granted")
        self.assertTrue(first["created"], first)
        self.assertEqual(first["addr"], addr_a, "the pool is made where the first engine reserved it")
        b = self.child(ahead=True)
        addr_b, placed_b = self.event(b, "parked")["reserved"]
        self.assertTrue(placed_b, "the pool exists: its own addresses are reserved")
        self.assertEqual(addr_b, first["addr"])
        a.kill()
        second = self.event(b, "granted")
        self.assertEqual(second["addr"], addr_b)
        self.assertTrue(second["carried"], second)


class KvPoolInAllocations(KvPoolOverHostGms):
    """A pool gmsd makes of several allocations (``--kv-chunk``): a grant
    asked to map its first bytes only (``first_bytes``, what a promoted
    engine does) maps the first allocation, libgms maps the rest, and the
    whole pool is carried to the next engine; the tests above run over it
    too."""

    GMSD_ARGS = ["--kv-chunk", "1M"]

    def test_the_first_allocation_at_the_grant_and_the_rest_after(self):
        a = self.child(first=1)
        first = self.event(a, "granted")
        self.assertEqual(first["mapped_at_grant"], 1 << 20, f"the first allocation only: {first}")
        self.assertEqual((first["mapped"], first["size"]), (8 << 20, 8 << 20), first)
        b = self.child(first=1)
        self.event(b, "parked")
        a.kill()
        second = self.event(b, "granted")
        self.assertEqual((second["pool"], second["addr"]), (first["pool"], first["addr"]))
        self.assertTrue(second["carried"] and second["tail_carried"],
                        f"the first and the last allocations' contents are carried: {second}")


if __name__ == "__main__":
    unittest.main()
