"""When engine.py's main process pings the watchdog: the standard-library
part of its hang detection, apart from torch so that plain python3 tests
it (test_heartbeat.py).

The main process pings ``WATCHDOG=1`` (shadow_gms.Watchdog: each half
interval) from the loops that work: the wait for the lock, the serving
loop, the decode steps. In a tensor-parallel group (tp.py) it also needs
every rank's word: each rank prints a ``rank-beat`` line on the pipe it
already answers on (``RankBeat``), at least every ``beat_s`` (a quarter of
the interval) while it waits for a command and from its decode steps while
it generates. A rank stuck in a kernel or a collective stops beating; the
main process then stops pinging and the runtime ends the whole group.
"""

import json
import sys
import threading
import time

from shadow_gms import Progress


class Heartbeat:
    """The watchdog of a main process and its ``ranks`` other ranks (0: a
    one-process engine). ``enabled``, ``wait()`` and ``ping()`` are the
    watchdog's, so ``FailoverLock.acquire(watchdog=heartbeat)`` takes it;
    ``advanced(rank)`` may be called from any thread (the pipe readers)."""

    def __init__(self, watchdog, ranks=0):
        self.watchdog = watchdog
        self._progress = Progress(ranks)
        self._lock = threading.Lock()
        # The ranks' cadence: two beats in each half interval, so one late
        # beat still lands before the next ping is due.
        self.beat_s = watchdog.interval / 4 if watchdog.enabled else None

    @property
    def enabled(self):
        return self.watchdog.enabled

    @property
    def ranks(self):
        """How many other ranks it hears from."""
        return self._progress.ranks

    def advanced(self, rank):
        """Rank ``rank`` (0-based among the other ranks) beat."""
        with self._lock:
            self._progress.advanced(rank)

    def wait(self):
        """Seconds the caller may block before it should call ``ping()``
        again: until the next ping is due, or, when it is due but a rank
        has not beaten since the last ping, one beat (a rank that is only
        late is heard from by then). None without a watchdog."""
        wait = self.watchdog.wait()
        if wait is None or wait > 0:
            return wait
        with self._lock:
            return 0.0 if self._progress.all_advanced() else self.beat_s

    def ping(self):
        """Pings if one is due and every rank beat since the last ping;
        returns whether it sent."""
        with self._lock:
            if not (self.watchdog.due() and self._progress.all_advanced()):
                return False
            self._progress.reset()
        return self.watchdog.ping()


class RankBeat:
    """A rank's ``rank-beat`` lines on ``out`` (its stdout, the pipe to the
    main process): called from its command loop and its decode steps, it
    prints at most one each ``every / 2`` seconds, so a command loop that
    wakes each ``every`` (a wait may end a hair early) beats every time.
    ``every`` None (or empty): no watchdog, no beats."""

    def __init__(self, rank, every, out=None, clock=time.monotonic):
        self.rank = rank
        self.every = float(every) if every else None
        self._out = out
        self._clock = clock
        self._last = None

    def __call__(self):
        if self.every is None:
            return
        now = self._clock()
        if self._last is None or now - self._last >= self.every / 2:
            self._last = now
            out = self._out or sys.stdout
            out.write(json.dumps({"event": "rank-beat", "rank": self.rank}) + "\n")
            out.flush()
