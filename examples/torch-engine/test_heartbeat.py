"""Tests of heartbeat.py with plain python3 (no torch, no GPU):
``python3 -m unittest discover -s examples/torch-engine``; `cargo test -p
gms` runs them (gms/tests/python.rs). A clock moved by hand and a real
notify socket; nothing here asserts how long something took.
"""

import io
import json
import os
import socket
import sys
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "gms", "python"))
sys.path.insert(0, HERE)

from heartbeat import Heartbeat, RankBeat  # noqa: E402
from shadow_gms import Watchdog  # noqa: E402


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


class HeartbeatTest(unittest.TestCase):
    def setUp(self):
        d = tempfile.TemporaryDirectory()
        self.addCleanup(d.cleanup)
        path = os.path.join(d.name, "notify.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.addCleanup(self.sock.close)
        self.sock.bind(path)
        self.sock.setblocking(False)
        self.clock = Clock()
        self.env = {"WATCHDOG_USEC": "1000000", "NOTIFY_SOCKET": path}

    def pings(self):
        """The WATCHDOG=1 datagrams sent so far (and not yet counted)."""
        n = 0
        try:
            while True:
                self.assertEqual(self.sock.recv(4096), b"WATCHDOG=1")
                n += 1
        except BlockingIOError:
            return n

    def test_one_process_pings_as_its_watchdog(self):
        h = Heartbeat(Watchdog(self.env, clock=self.clock))
        self.assertTrue(h.enabled)
        self.assertEqual(h.ranks, 0)
        self.assertEqual(h.beat_s, 0.25)
        self.assertEqual(h.wait(), 0)
        self.assertTrue(h.ping())
        self.assertFalse(h.ping())
        self.assertEqual(h.wait(), 0.5)
        self.clock.now += 0.5
        self.assertTrue(h.ping())
        self.assertEqual(self.pings(), 2)

    def test_without_a_watchdog_it_never_pings_nor_times_out(self):
        h = Heartbeat(Watchdog({}, clock=self.clock), ranks=2)
        self.assertFalse(h.enabled)
        self.assertIsNone(h.beat_s)
        self.assertIsNone(h.wait())
        h.advanced(0)
        h.advanced(1)
        self.assertFalse(h.ping())

    def test_a_group_pings_only_when_every_rank_beat(self):
        h = Heartbeat(Watchdog(self.env, clock=self.clock), ranks=2)
        self.assertEqual(h.ranks, 2)
        # Due at once, but no rank beat yet: wait a beat, send nothing.
        self.assertEqual(h.wait(), 0.25)
        self.assertFalse(h.ping())
        h.advanced(0)
        self.assertEqual(h.wait(), 0.25)
        self.assertFalse(h.ping())
        h.advanced(1)
        self.assertEqual(h.wait(), 0)
        self.assertTrue(h.ping())
        self.assertEqual(self.pings(), 1)
        # The next ping needs both again.
        self.clock.now += 0.5
        h.advanced(1)
        self.assertFalse(h.ping())
        h.advanced(0)
        self.assertTrue(h.ping())
        # Rank 0 is stuck from here on: rank 1 alone is not enough.
        for _ in range(10):
            self.clock.now += 0.25
            h.advanced(1)
            self.assertFalse(h.ping())
            self.assertEqual(h.wait(), 0.25, "due: wait one beat, never spin")
        self.assertEqual(self.pings(), 1)
        h.advanced(5)  # no such rank
        self.assertFalse(h.ping())


class RankBeatTest(unittest.TestCase):
    def test_beats_at_most_every_half_cadence(self):
        out, clock = io.StringIO(), Clock()
        beat = RankBeat(3, "0.25", out=out, clock=clock)
        self.assertEqual(beat.every, 0.25)
        beat()
        beat()  # the same instant: one line
        clock.now += 0.1
        beat()
        clock.now += 0.025
        beat()  # 0.125 since the first: the second line
        clock.now += 0.25
        beat()  # a command loop that waited one beat
        lines = out.getvalue().splitlines()
        self.assertEqual([json.loads(line) for line in lines], [{"event": "rank-beat", "rank": 3}] * 3)

    def test_no_cadence_no_beats(self):
        out = io.StringIO()
        for every in (None, ""):
            beat = RankBeat(1, every, out=out)
            self.assertIsNone(beat.every)
            beat()
        self.assertEqual(out.getvalue(), "")


if __name__ == "__main__":
    unittest.main()
