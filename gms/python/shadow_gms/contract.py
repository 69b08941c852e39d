"""The engine contract's process side: the failover lock and sd_notify.

The lock is a plain ``flock(LOCK_EX)`` on SHADOW_LOCK_PATH: the kernel
releases it when the holder dies, however it dies, which is what wakes the
shadow. Notifications follow systemd's datagram protocol, so the shim (or a
test) learns who is parked and who is ready.
"""

import fcntl
import os
import socket


def notify(*fields, path=None):
    """Sends ``KEY=value`` lines to NOTIFY_SOCKET; a no-op when it is unset.

    Returns True when a datagram was sent.
    """
    path = path or os.environ.get("NOTIFY_SOCKET")
    if not path:
        return False
    if path.startswith("@"):
        path = "\0" + path[1:]  # abstract socket namespace
    msg = "\n".join(fields).encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
        s.sendto(msg, path)
    return True


class FailoverLock:
    """``flock`` on the pair's election lock; held until this process dies."""

    def __init__(self, path=None):
        self.path = path or os.environ.get("SHADOW_LOCK_PATH", "/run/shadow/pair/engine.lock")
        self.fd = None

    def acquire(self):
        """Blocks until this engine is the active one."""
        fd = os.open(self.path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except BaseException:
            os.close(fd)
            raise
        self.fd = fd
        return self

    def try_acquire(self):
        """True if the lock was free and is now ours."""
        fd = os.open(self.path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        self.fd = fd
        return True

    def release(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
