"""Tests of shadow_gms.LockHolder, the election lock held by a small
process: real processes, real SIGKILLs, standard library only.

`cargo test -p gms` runs them (gms/tests/python.rs), so `make test` does.
Every wait is bounded by LIMIT_S, which only a broken helper reaches. The
one comparison of times is a ratio within one run: the shadow's wake after
a SIGKILL of a large engine, with the lock held by the engine itself and
through the helper.
"""

import ctypes
import fcntl
import os
import select
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import unittest

PY_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path.insert(0, PY_ROOT)

from shadow_gms.contract import LockHolder, Watchdog  # noqa: E402

LIMIT_S = 30
PR_SET_CHILD_SUBREAPER = 36

# An engine: takes the lock its way ("direct": FailoverLock, "holder":
# LockHolder started before it grows, "started": LockHolder started and
# never asked), grows to MIB of touched memory, prints the pid that holds
# the lock (or the holder's), then sleeps until killed.
ENGINE = """
import os, sys, time
sys.path.insert(0, sys.argv[4])
from shadow_gms.contract import FailoverLock, LockHolder
mode, path, mib = sys.argv[1], sys.argv[2], int(sys.argv[3])
if mode != "direct":
    lock = LockHolder(path).start()
grown = b"\\1" * (mib << 20)
if mode == "direct":
    FailoverLock(path).acquire()
    print(os.getpid(), flush=True)
elif mode == "holder":
    lock.acquire()
    print(lock.pid, lock.held, flush=True)
else:
    print(lock.pid, lock.held, flush=True)
time.sleep(3600)
"""


def median_ms(xs):
    return round(statistics.median(xs) * 1000, 1)


class LockTest(unittest.TestCase):
    @classmethod
    def setUpClass(cls):
        # A holder orphaned by its engine's death is reparented to this
        # process, which reaps it: the proof that it is gone.
        cls.libc = ctypes.CDLL(None, use_errno=True)
        cls.libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)

    @classmethod
    def tearDownClass(cls):
        cls.libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)

    def setUp(self):
        d = tempfile.TemporaryDirectory()
        self.addCleanup(d.cleanup)
        self.path = os.path.join(d.name, "engine.lock")
        open(self.path, "w").close()
        self.ino = os.stat(self.path).st_ino

    def lock_holders(self):
        """The pids /proc/locks lists as holding this test's lock."""
        pids = []
        with open("/proc/locks") as f:
            for line in f:
                fields = line.split()
                if "->" in fields or len(fields) < 6:
                    continue
                if fields[5].rsplit(":", 1)[-1] == str(self.ino):
                    pids.append(int(fields[4]))
        return pids

    def is_held(self):
        fd = os.open(self.path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return False
        except BlockingIOError:
            return True
        finally:
            os.close(fd)

    def engine(self, mode, mib=0):
        """Starts an engine; returns it and the line it printed."""
        p = subprocess.Popen([sys.executable, "-c", ENGINE, mode, self.path, str(mib), PY_ROOT],
                             stdout=subprocess.PIPE, stdin=subprocess.DEVNULL)
        self.addCleanup(self.end, p)
        ready, _, _ = select.select([p.stdout], [], [], LIMIT_S)
        self.assertTrue(ready, f"the {mode} engine never said it holds the lock")
        line = p.stdout.readline().decode().split()
        if not line:
            self.fail(f"the {mode} engine died before holding the lock: {p.wait()}")
        return p, line

    def end(self, p):
        if p.poll() is None:
            p.kill()
        p.wait()
        p.stdout.close()

    def reap(self, pid):
        """Waits (bounded) for an orphaned holder to exit, and reaps it."""
        deadline = time.monotonic() + LIMIT_S
        while time.monotonic() < deadline:
            try:
                done, _ = os.waitpid(pid, os.WNOHANG)
            except ChildProcessError:
                # Reaped already, by its engine's own reaper thread (the
                # holder can die, of PDEATHSIG, before that thread does).
                if not os.path.exists(f"/proc/{pid}"):
                    return
                done = 0
            if done == pid:
                return
            time.sleep(0.005)
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        self.fail(f"holder {pid} outlived its engine")

    def wake_after_kill(self, pid):
        """SIGKILLs ``pid`` alone and blocks in flock as the shadow does:
        the seconds from the kill to the lock."""
        fd = os.open(self.path, os.O_RDONLY)

        def late(*_):
            raise TimeoutError(f"the lock was not free {LIMIT_S} s after the kill")

        old = signal.signal(signal.SIGALRM, late)
        signal.alarm(LIMIT_S)
        try:
            start = time.monotonic()
            os.kill(pid, signal.SIGKILL)
            fcntl.flock(fd, fcntl.LOCK_EX)
            return time.monotonic() - start
        finally:
            signal.alarm(0)
            signal.signal(signal.SIGALRM, old)
            os.close(fd)

    def test_the_holder_holds_it_for_the_engine(self):
        h = LockHolder(self.path).start()
        self.assertFalse(self.is_held(), "taken before acquire(): an engine still starting would be active")
        self.assertFalse(h.held)
        self.assertIs(h.acquire(timeout=LIMIT_S), h)
        self.assertTrue(h.held)
        self.assertTrue(self.is_held())
        # The kernel lists the holder, a child of this process (in an
        # engine's cgroup under the runtime), not the engine.
        self.assertEqual(self.lock_holders(), [h.pid])
        with open(f"/proc/{h.pid}/stat") as f:
            self.assertEqual(int(f.read().rsplit(")", 1)[1].split()[1]), os.getpid())
        pid = h.pid
        h.release()
        self.assertFalse(h.held)
        self.assertFalse(self.is_held())
        self.assertFalse(os.path.exists(f"/proc/{pid}"), "the holder was reaped")

    def test_a_parked_engine_pings_while_the_holder_waits(self):
        other = os.open(self.path, os.O_RDONLY)
        fcntl.flock(other, fcntl.LOCK_EX)
        with tempfile.TemporaryDirectory() as d:
            import socket
            notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            self.addCleanup(notify.close)
            notify.bind(os.path.join(d, "notify.sock"))
            notify.settimeout(LIMIT_S)
            w = Watchdog({"WATCHDOG_USEC": "20000", "NOTIFY_SOCKET": os.path.join(d, "notify.sock")})
            h = LockHolder(self.path)
            self.addCleanup(h.release)
            done, errors = threading.Event(), []

            def park():
                try:
                    h.acquire(watchdog=w)
                except BaseException as e:
                    errors.append(e)
                done.set()

            threading.Thread(target=park, daemon=True).start()
            for _ in range(3):
                self.assertEqual(notify.recv(64), b"WATCHDOG=1")
            self.assertFalse(done.is_set())
            os.close(other)  # the active engine dies
            self.assertTrue(done.wait(LIMIT_S), "the holder never took the freed lock")
            self.assertEqual(errors, [])
            self.assertTrue(h.held)
            self.assertEqual(self.lock_holders(), [h.pid])

    def test_a_timeout_ends_the_holder_and_leaves_the_lock(self):
        other = os.open(self.path, os.O_RDONLY)
        self.addCleanup(os.close, other)
        fcntl.flock(other, fcntl.LOCK_EX)
        h = LockHolder(self.path).start()
        pid = h.pid
        with self.assertRaises(TimeoutError):
            h.acquire(timeout=0.05)
        self.assertFalse(h.held)
        self.assertFalse(os.path.exists(f"/proc/{pid}"), "the holder was ended and reaped")
        fcntl.flock(other, fcntl.LOCK_UN)
        h.acquire(timeout=LIMIT_S)
        self.assertNotEqual(h.pid, pid, "a new holder")
        self.assertEqual(self.lock_holders(), [h.pid])
        h.release()

    def test_a_lone_kill_of_the_engine_frees_the_lock(self):
        p, (holder, held) = self.engine("holder")
        self.assertEqual(held, "True", "the engine learnt it holds the lock")
        self.assertEqual(self.lock_holders(), [int(holder)])
        # Only the engine's main pid: its holder must go by itself.
        self.wake_after_kill(p.pid)
        p.wait()
        self.reap(int(holder))

    def test_a_holder_killed_alone_ends_its_engine(self):
        # The lock is free once its holder dies: an engine that went on
        # serving would serve beside the shadow.
        p, (holder, held) = self.engine("holder")
        self.assertEqual(held, "True")
        os.kill(int(holder), signal.SIGKILL)
        try:
            status = p.wait(LIMIT_S)
        except subprocess.TimeoutExpired:
            self.fail("the engine went on without its lock")
        self.assertEqual(status, -signal.SIGKILL)
        self.assertFalse(self.is_held())

    def test_an_engine_killed_before_acquire_takes_nothing(self):
        p, (holder, held) = self.engine("started")
        self.assertEqual(held, "False")
        self.assertFalse(self.is_held())
        p.kill()
        p.wait()
        self.reap(int(holder))
        self.assertFalse(self.is_held())

    def test_the_shadow_wakes_faster_through_the_holder(self):
        # 1.5 GiB of touched memory: the kernel frees it before it drops
        # the flock of a process that holds it itself. Figures:
        # LOCKHOLDER_FIGURES=1024,2048 LOCKHOLDER_RUNS=5 (MiB, kills per arm).
        sizes = [int(m) for m in os.environ.get("LOCKHOLDER_FIGURES", "1536").split(",")]
        runs = int(os.environ.get("LOCKHOLDER_RUNS", "3"))
        for mib in sizes:
            direct, helper = [], []
            # Alternated, so that a busy machine slows both arms alike.
            for _ in range(runs):
                for mode, times in (("direct", direct), ("holder", helper)):
                    p, line = self.engine(mode, mib)
                    times.append(self.wake_after_kill(p.pid))
                    p.wait()
                    if mode == "holder":
                        self.reap(int(line[0]))
            print(f"\nkill (engine's pid alone) -> shadow's flock at {mib} MiB: direct {median_ms(direct)} ms, "
                  f"through the holder {median_ms(helper)} ms (medians of {runs})", file=sys.stderr)
            self.assertLess(statistics.median(helper) * 4, statistics.median(direct),
                            f"{mib} MiB: direct {direct}, holder {helper}")

if __name__ == "__main__":
    unittest.main()
