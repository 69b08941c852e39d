"""Tests of shadow_gms.contract's watchdog helpers, standard library only
(no torch, no GPU): ``python3 -m unittest discover -s gms/python/tests``.

`cargo test -p gms` runs them (gms/tests/python.rs), so `make test` does.
Every wait is bounded by a timeout that only a broken helper reaches;
nothing here asserts how long something took.
"""

import fcntl
import os
import socket
import sys
import tempfile
import threading
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from shadow_gms import contract  # noqa: E402
from shadow_gms.contract import FailoverLock, Progress, Watchdog, extend_start, watchdog_interval  # noqa: E402

# Only a broken helper waits this long.
LIMIT_S = 20


class Clock:
    """A clock the test moves by hand."""

    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


class NotifySocket:
    """The runtime's side of NOTIFY_SOCKET: a datagram socket in a temp dir."""

    def __init__(self, test):
        d = tempfile.TemporaryDirectory()
        test.addCleanup(d.cleanup)
        self.path = os.path.join(d.name, "notify.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        test.addCleanup(self.sock.close)
        self.sock.bind(self.path)

    def recv(self, timeout=LIMIT_S):
        self.sock.settimeout(timeout)
        return self.sock.recv(4096).decode()

    def pending(self):
        """Every datagram already queued, without waiting."""
        out = []
        self.sock.setblocking(False)
        try:
            while True:
                out.append(self.sock.recv(4096).decode())
        except BlockingIOError:
            return out


class IntervalTest(unittest.TestCase):
    def test_read_as_systemd_reads_it(self):
        def interval(usec=None, pid=None):
            env = {}
            if usec is not None:
                env["WATCHDOG_USEC"] = usec
            if pid is not None:
                env["WATCHDOG_PID"] = pid
            return watchdog_interval(env, pid=42)

        self.assertEqual(interval("500000"), 0.5)
        self.assertEqual(interval("500000", "42"), 0.5)
        self.assertEqual(interval("1", "42"), 1e-6)
        # Another process's watchdog: a rank that inherited the variables.
        self.assertIsNone(interval("500000", "1"))
        self.assertIsNone(interval())
        self.assertIsNone(interval(None, "42"))
        for bad in ["", "0", "+5", "-5", " 5", "5 ", "5s", "0x10", "1e6", "18446744073709551616", "٣"]:
            self.assertIsNone(interval(bad), f"WATCHDOG_USEC={bad!r}")
        for bad in ["", "x", "+42", "42 ", "-1"]:
            self.assertIsNone(interval("500000", bad), f"WATCHDOG_PID={bad!r}")

    def test_own_pid_by_default(self):
        env = {"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid())}
        self.assertEqual(watchdog_interval(env), 2.0)
        self.assertTrue(Watchdog(env).enabled)
        self.assertFalse(Watchdog({"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": str(os.getpid() + 1)}).enabled)


class WatchdogTest(unittest.TestCase):
    def setUp(self):
        self.notify = NotifySocket(self)
        self.clock = Clock()

    def watchdog(self, usec="1000000"):
        env = {"NOTIFY_SOCKET": self.notify.path}
        if usec is not None:
            env["WATCHDOG_USEC"] = usec
        return Watchdog(env, clock=self.clock)

    def test_pings_at_once_then_every_half_interval(self):
        w = self.watchdog()
        self.assertTrue(w.enabled)
        self.assertEqual(w.interval, 1.0)
        self.assertTrue(w.due())
        self.assertEqual(w.wait(), 0)
        self.assertTrue(w.ping(), "the first ping arms the watchdog")
        self.assertEqual(self.notify.recv(), "WATCHDOG=1")
        self.assertFalse(w.due())
        self.assertEqual(w.wait(), 0.5)
        self.assertFalse(w.ping(), "not due: nothing sent")
        self.clock.now += 0.3
        self.assertAlmostEqual(w.wait(), 0.2)
        self.assertFalse(w.ping())
        self.clock.now += 0.2
        self.assertTrue(w.due())
        self.assertTrue(w.ping())
        self.assertEqual(self.notify.recv(), "WATCHDOG=1")
        self.clock.now += 10
        self.assertEqual(w.wait(), 0, "late: due, never negative")
        self.assertTrue(w.ping())
        self.assertEqual(self.notify.recv(), "WATCHDOG=1")
        self.assertEqual(self.notify.pending(), [], "one datagram per ping")

    def test_disabled_sends_nothing_and_waits_forever(self):
        w = self.watchdog(usec=None)
        self.assertFalse(w.enabled)
        self.assertIsNone(w.interval)
        self.assertIsNone(w.wait(), "select's and Event.wait's 'no timeout'")
        self.assertFalse(w.due())
        self.assertFalse(w.ping())
        self.assertEqual(self.notify.pending(), [])

    def test_a_refused_send_counts_as_the_ping(self):
        env = {"WATCHDOG_USEC": "1000000", "NOTIFY_SOCKET": self.notify.path + ".gone"}
        w = Watchdog(env, clock=self.clock)
        self.assertFalse(w.ping(), "nobody listens there")
        self.assertFalse(w.due(), "a loop timed by wait() does not spin")
        # No NOTIFY_SOCKET at all: nothing sent, paced the same.
        w = Watchdog({"WATCHDOG_USEC": "1000000"}, clock=self.clock)
        self.assertFalse(w.ping())
        self.assertEqual(w.wait(), 0.5)

    def test_a_full_socket_loses_the_ping_without_waiting(self):
        # Fill the runtime's queue (it is not reading), as a flood would.
        filler = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.addCleanup(filler.close)
        filler.setblocking(False)
        try:
            while True:
                filler.sendto(b"STATUS=flood", self.notify.path)
        except BlockingIOError:
            pass
        w = self.watchdog()
        sent = []
        t = threading.Thread(target=lambda: sent.append(w.ping()), daemon=True)
        t.start()
        t.join(LIMIT_S)
        self.assertFalse(t.is_alive(), "ping() waited for room on a full socket")
        self.assertEqual(sent, [False])
        self.assertFalse(w.due(), "the lost ping counts as this period's")

    def test_trigger_and_extend_start(self):
        self.assertTrue(self.watchdog().trigger())
        self.assertEqual(self.notify.recv(), "WATCHDOG=trigger")
        self.assertTrue(extend_start(90, path=self.notify.path))
        self.assertEqual(self.notify.recv(), "EXTEND_TIMEOUT_USEC=90000000")
        self.assertTrue(extend_start(0.25, path=self.notify.path))
        self.assertEqual(self.notify.recv(), "EXTEND_TIMEOUT_USEC=250000")
        for bad in (0, -1, 1e-7):
            with self.assertRaises(ValueError):
                extend_start(bad, path=self.notify.path)
        self.assertFalse(extend_start(1, path=self.notify.path + ".gone"))
        self.assertEqual(self.notify.pending(), [])


class ProgressTest(unittest.TestCase):
    def test_every_rank_since_the_reset(self):
        p = Progress(3)
        self.assertEqual(p.ranks, 3)
        self.assertFalse(p.all_advanced())
        p.advanced(0)
        p.advanced(2)
        p.advanced(2)
        self.assertFalse(p.all_advanced(), "rank 1 never advanced")
        p.advanced(7)
        p.advanced(-1)
        self.assertFalse(p.all_advanced(), "no such ranks: ignored")
        p.advanced(1)
        self.assertTrue(p.all_advanced())
        p.reset()
        self.assertFalse(p.all_advanced())
        self.assertTrue(Progress(0).all_advanced())

    def test_a_stuck_rank_stops_the_pings(self):
        notify = NotifySocket(self)
        clock = Clock()
        w = Watchdog({"WATCHDOG_USEC": "100000", "NOTIFY_SOCKET": notify.path}, clock=clock)
        p = Progress(2)
        sent = []

        def tick():
            if w.due() and p.all_advanced() and w.ping():
                p.reset()
                sent.append(round(clock.now - 1000.0, 3))

        p.advanced(0)
        p.advanced(1)
        tick()
        p.advanced(0)
        p.advanced(1)
        clock.now += 0.05
        tick()
        for _ in range(10):  # rank 1 is stuck from here on
            clock.now += 0.05
            p.advanced(0)
            tick()
        self.assertEqual(sent, [0.0, 0.05])


class LockTest(unittest.TestCase):
    def setUp(self):
        d = tempfile.TemporaryDirectory()
        self.addCleanup(d.cleanup)
        self.path = os.path.join(d.name, "engine.lock")
        open(self.path, "w").close()
        self.notify = NotifySocket(self)

    def hold(self):
        """The other engine: holds the lock until its descriptor closes."""
        fd = os.open(self.path, os.O_RDONLY)
        fcntl.flock(fd, fcntl.LOCK_EX)
        return fd

    def is_held(self):
        fd = os.open(self.path, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return False
        except BlockingIOError:
            return True
        finally:
            os.close(fd)

    def test_a_parked_engine_pings_and_wakes_when_the_lock_is_free(self):
        other = self.hold()
        w = Watchdog({"WATCHDOG_USEC": "20000", "NOTIFY_SOCKET": self.notify.path})
        lock = FailoverLock(self.path)
        done = threading.Event()
        errors = []

        def park():
            try:
                lock.acquire(watchdog=w)
            except BaseException as e:
                errors.append(e)
            done.set()

        threading.Thread(target=park, daemon=True).start()
        # Parked: pings keep coming while the lock is the other's.
        for _ in range(3):
            self.assertEqual(self.notify.recv(), "WATCHDOG=1")
        self.assertFalse(done.is_set())
        os.close(other)  # the active engine dies
        self.assertTrue(done.wait(LIMIT_S), "the parked engine did not take the lock")
        self.assertEqual(errors, [])
        self.assertIsNotNone(lock.fd)
        self.assertTrue(self.is_held(), "the lock is the woken engine's")
        lock.release()
        self.assertFalse(self.is_held())

    def test_without_a_watchdog_the_lock_is_taken_as_before(self):
        lock = FailoverLock(self.path).acquire(watchdog=Watchdog({}))
        self.assertTrue(self.is_held())
        lock.release()
        lock = FailoverLock(self.path).acquire()
        self.assertTrue(self.is_held())
        lock.release()
        self.assertEqual(self.notify.pending(), [])

    def test_a_failed_flock_is_raised_in_the_waiting_thread(self):
        w = Watchdog({"WATCHDOG_USEC": "20000", "NOTIFY_SOCKET": self.notify.path})
        real = contract.fcntl.flock

        def refuse(fd, op):
            raise OSError(5, "refused by the test")

        contract.fcntl.flock = refuse
        try:
            with self.assertRaises(OSError):
                FailoverLock(self.path).acquire(watchdog=w)
        finally:
            contract.fcntl.flock = real


if __name__ == "__main__":
    unittest.main()
