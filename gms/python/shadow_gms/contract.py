"""The engine contract's process side: the failover lock, sd_notify and
the pair's listening sockets.

The lock is a plain ``flock(LOCK_EX)`` on SHADOW_LOCK_PATH: the kernel
releases it when the holder dies, however it dies, which is what wakes the
shadow. Notifications follow systemd's datagram protocol, so the shim (or a
test) learns who is parked and who is ready. A pair with
``shadow.dev/listen`` hands its listening sockets down by systemd's socket
activation (LISTEN_FDS, LISTEN_PID, LISTEN_FDNAMES, descriptors from 3):
``listen_socket()`` takes them.
"""

import fcntl
import os
import socket

# The exit status of an engine that found the committed weights changed
# (shadow_contract::weights::CORRUPT_EXIT): the runtime restarts the pair cold.
CORRUPT_EXIT = 65


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


LISTEN_FDS_START = 3
_inherited = None


def listen_sockets():
    """The listening sockets this process inherited, ``[(name, socket.socket)]``.

    As ``sd_listen_fds(3)``: none unless LISTEN_PID is this process's pid and
    LISTEN_FDS a count; then descriptors 3.. are taken (made
    non-inheritable) and wrapped once; later calls return the same sockets.
    A parked engine holds them but must not ``accept`` before it is active.
    """
    global _inherited
    if _inherited is not None:
        return list(_inherited)
    _inherited = []
    try:
        if int(os.environ.get("LISTEN_PID", "")) != os.getpid():
            return []
        n = int(os.environ.get("LISTEN_FDS", ""))
    except ValueError:
        return []
    names = os.environ.get("LISTEN_FDNAMES", "").split(":")
    for i in range(max(0, min(n, 1024))):
        fd = LISTEN_FDS_START + i
        try:
            os.set_inheritable(fd, False)
            sock = socket.socket(fileno=fd)
        except OSError:
            continue
        name = names[i] if i < len(names) and names[i] else "unknown"
        _inherited.append((name, sock))
    return list(_inherited)


def listen_socket(name=None):
    """The first inherited listening socket (or the one named ``name``, e.g.
    ``tcp-8000``), or None: then the engine binds its own port."""
    for n, sock in listen_sockets():
        if name is None or n == name:
            return sock
    return None
