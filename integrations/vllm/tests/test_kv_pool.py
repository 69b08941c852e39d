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

# One engine: its Gms lease first (parked work), then the lock (unless
# --no-lock), then the pool; a pool it made gets a pattern; one line of
# JSON per step; stdin's EOF ends it.
CHILD = textwrap.dedent("""
    import fcntl, json, os, sys, time
    import torch
    from shadow_gms.client import Gms
    lock_path, take = sys.argv[1], sys.argv[2] == "lock"
    gms = Gms(mode="rw_or_ro", client="kv-pool-test", device="host", timeout_s=20)
    if gms.lease == "rw":
        gms.commit()
    print(json.dumps({"event": "parked", "pid": os.getpid()}), flush=True)
    fd = os.open(lock_path, os.O_RDONLY | os.O_CLOEXEC)
    if take:
        fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        pool = gms.kv_pool(fd, 8 << 20, 4096)
    except Exception as e:
        print(json.dumps({"event": "refused", "error": str(e)}), flush=True)
        sys.exit(0)
    head = pool.tensor(torch.int64, shape=(1024,))
    want = torch.arange(1024, dtype=torch.int64) * 5 + 1
    if pool.created:
        head.copy_(want)
    print(json.dumps({"event": "granted", "created": pool.created, "pool": pool.pool, "addr": pool.addr,
                      "carried": bool(torch.equal(head, want)), "index": os.pread(pool.index_fd, 4, 0).hex(),
                      "fenced": pool.fenced(10.0)}), flush=True)
    if pool.created:
        os.pwrite(pool.index_fd, b"mark", 0)
    sys.stdin.read()
    pool.close()
""")


class KvPoolOverHostGms(unittest.TestCase):
    def setUp(self):
        self.tmp = tempfile.TemporaryDirectory(prefix="shadow-kv-pool-")
        self.lock = os.path.join(self.tmp.name, "lock")
        open(self.lock, "w").close()
        self.gmsd = Gmsd(extra=["--lock", self.lock])
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

    def child(self, take=True):
        c = subprocess.Popen([sys.executable, "-c", CHILD, self.lock, "lock" if take else "none"],
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


if __name__ == "__main__":
    unittest.main()
