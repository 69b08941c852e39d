"""A vLLM process dies with the process that started it.

Why: vLLM runs an API server, an EngineCore under it and, on some
platforms, workers under that. SIGKILL of the API server alone leaves the
EngineCore and its workers running (holding gigabytes, /dev/shm files, a
notify socket they may still ping). Under the shim the whole cgroup is
killed anyway; elsewhere (a test, a shell, a runtime that kills one pid)
nothing would end them. Each non-main vLLM process therefore watches its
parent through a pidfd and kills itself the moment the parent is gone, so
the kill cascades down the tree in a few milliseconds.

A pidfd rather than ``PR_SET_PDEATHSIG``: the death signal follows the
parent *thread* that forked, and vLLM may start processes from a thread
that ends long before the process does.
"""

import os
import select
import signal
import threading

# The API server's pid (shadow_vllm.pair.MAIN_PID_VAR).
MAIN_PID_VAR = "SHADOW_VLLM_MAIN_PID"

_started_for = None


def _watch(pidfd):
    try:
        select.select([pidfd], [], [])
    except OSError:
        return
    os.kill(os.getpid(), signal.SIGKILL)


def start():
    """Starts the watch of this process's parent (once per process; again in
    a forked child). Kills this process at once if the parent is already
    gone. Returns whether a watch runs."""
    global _started_for
    pid = os.getpid()
    if _started_for == pid:
        return True
    ppid = os.getppid()
    if ppid == 1 and os.environ.get(MAIN_PID_VAR) != "1":
        # Reparented to init: the parent died before the watch began. (In a
        # container of its own the API server is pid 1 and 1 is the parent.)
        os.kill(pid, signal.SIGKILL)
    try:
        pidfd = os.pidfd_open(ppid)
    except (OSError, AttributeError):
        return False
    if os.getppid() != ppid:
        # It died between getppid and pidfd_open (and the pid was reused).
        os.kill(pid, signal.SIGKILL)
    _started_for = pid
    threading.Thread(target=_watch, args=(pidfd,), name="shadow-parent-watch", daemon=True).start()
    return True


def _after_fork():
    global _started_for
    _started_for = None
    start()


def start_here_and_in_forks():
    """``start()`` now, and again in every child this process forks (a
    forked child does not run plugin loading again)."""
    start()
    os.register_at_fork(after_in_child=_after_fork)
