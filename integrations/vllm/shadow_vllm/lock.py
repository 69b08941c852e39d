"""Taking the pair's election lock: the one place that does it.

Why a module: how the lock is held decides how fast the shadow wakes. The
kernel drops a killed process's flock only once it has freed that
process's memory (about 100 ms a GiB here, and a vLLM API server is
gigabytes), so the lock is better held by a small process forked before
vLLM is imported. ``prepare()`` runs first thing in ``shadow-vllm``, before
any vLLM import, and ``acquire()`` blocks until this engine is the active
one; swapping how the lock is held changes this module alone.
"""

import os

from shadow_gms import contract

# The helper that holds the lock in a small process (shadow_gms.LockHolder),
# where this shadow_gms has it; else the engine's own process holds it.
_HOLDER = getattr(contract, "LockHolder", None)
_prepared = {}


def prepare(path=None):
    """Called before vLLM is imported: starts the small process that will
    hold the lock (it has to be spawned while this process is small and
    has no threads of vLLM's). A no-op without SHADOW_LOCK_PATH."""
    path = path or os.environ.get("SHADOW_LOCK_PATH")
    if path and _HOLDER is not None and path not in _prepared:
        _prepared[path] = _HOLDER(path).start()


def acquire(path, watchdog=None):
    """Blocks until this engine holds the lock at ``path``, pinging
    ``watchdog`` while it waits; returns what keeps the lock held (keep it
    for the life of the process)."""
    if _HOLDER is not None:
        holder = _prepared.get(path) or _HOLDER(path)
        return holder.acquire(watchdog)
    return contract.FailoverLock(path).acquire(watchdog)


def holder_kind():
    """Which way the lock is held, for the log."""
    return "a lock-holder process" if _HOLDER is not None else "the engine's own process"
