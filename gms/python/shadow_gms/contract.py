"""The engine contract's process side: the failover lock, sd_notify and
the pair's listening sockets.

The lock is a plain ``flock(LOCK_EX)`` on SHADOW_LOCK_PATH: the kernel
releases it when the holder dies, however it dies, which is what wakes the
shadow. Notifications follow systemd's datagram protocol, so the shim (or a
test) learns who is parked and who is ready. A pair with
``shadow.dev/listen`` hands its listening sockets down by systemd's socket
activation (LISTEN_FDS, LISTEN_PID, LISTEN_FDNAMES, descriptors from 3):
``listen_socket()`` takes them. The pair's fd store (``FDSTORE=1``) keeps
descriptors an engine stores across its death: ``fdstore_store``,
``fdstore_remove``, and ``fdstore_fetch`` for the engine that takes over.

A pair with ``shadow.dev/watchdog`` gives its engines systemd's watchdog
(WATCHDOG_USEC, WATCHDOG_PID): once armed by a first ``WATCHDOG=1``, an
engine that lets a gap longer than the interval pass between two pings is
ended and failed over. ``Watchdog`` paces the pings; they must come from
the loops that do the work (the serving loop, the decode steps, the wait
for the lock), never from a timer thread, so that a stuck loop stops them.
``Progress`` tells a group's main process whether every rank advanced since
its last ping. ``extend_start()`` asks for more time before the start
timeout (``shadow.dev/start-timeout``) ends an engine still starting.
"""

import array
import fcntl
import mmap
import os
import signal
import socket
import stat
import threading
import time

# The exit status of an engine that found the committed weights changed
# (shadow_contract::weights::CORRUPT_EXIT): the runtime restarts the pair cold.
CORRUPT_EXIT = 65


def notify(*fields, path=None, block=True):
    """Sends ``KEY=value`` lines to NOTIFY_SOCKET; a no-op when it is unset.

    Returns True when a datagram was sent. With ``block=False`` a socket
    whose queue is full (a runtime not reading, or one flooded by the other
    engine) raises BlockingIOError at once instead of waiting for room.
    """
    path = path or os.environ.get("NOTIFY_SOCKET")
    if not path:
        return False
    if path.startswith("@"):
        path = "\0" + path[1:]  # abstract socket namespace
    msg = "\n".join(fields).encode()
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
        s.setblocking(block)
        s.sendto(msg, path)
    return True


class FailoverLock:
    """``flock`` on the pair's election lock; held until this process dies.

    The kernel frees it only after this process's memory is torn down
    (~100 ms per GiB or more): an engine of more than a few hundred MiB
    holds it through ``LockHolder`` instead."""

    def __init__(self, path=None):
        self.path = path or os.environ.get("SHADOW_LOCK_PATH", "/run/shadow/pair/engine.lock")
        self.fd = None

    def acquire(self, watchdog=None):
        """Blocks until this engine is the active one.

        With a ``watchdog`` that is enabled (a ``Watchdog``, or anything with
        its ``enabled``, ``wait()`` and ``ping()``), the parked engine keeps
        pinging while it waits: the flock blocks in a thread of its own and
        this thread waits for it with a timeout of ``watchdog.wait()``,
        pinging at each timeout. The wait ends the moment the lock is taken,
        so the wake never waits for a ping.
        """
        fd = os.open(self.path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
        if watchdog is None or not watchdog.enabled:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except BaseException:
                os.close(fd)
                raise
            self.fd = fd
            return self
        taken = threading.Event()
        failed = []

        def take():
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except BaseException as e:  # handed to the waiting thread
                failed.append(e)
            finally:
                taken.set()

        threading.Thread(target=take, name="failover-lock", daemon=True).start()
        while not taken.wait(watchdog.wait()):
            watchdog.ping()
        if failed:
            os.close(fd)
            raise failed[0]
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



# The holder process's program (``LockHolder``): a fresh interpreter that
# imports nothing but what it runs, so that its own exit, and with it the
# flock's release, takes a few milliseconds. Its arguments: the socket to
# the engine, the memfd of the shared mutex, the engine's pid, the path.
_HOLDER = """
import ctypes, fcntl, mmap, os, sys
link, memfd, engine, path = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
libc = ctypes.CDLL(None, use_errno=True)
# Killed when the engine's thread that spawned this process ends (the
# engine's death): the guard for the wait in flock, before the mutex.
if libc.prctl(1, 9, 0, 0, 0) != 0:  # PR_SET_PDEATHSIG, SIGKILL
    os._exit(70)
if os.getppid() != engine:  # the engine died before the prctl
    os._exit(71)
shared = mmap.mmap(memfd, 4096)
os.close(memfd)
if os.read(link, 1) != b"G":  # the engine died or let go before asking
    os._exit(0)
try:
    fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_CLOEXEC, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
except OSError as e:
    os.write(link, b"E%d %s" % (e.errno or 0, str(e).encode()[:400]))
    os._exit(72)
os.write(link, b"L")
# Returns the moment the engine's owning thread dies (EOWNERDEAD: the
# kernel walks a dying thread's robust list before it frees the memory)
# or unlocks (release); this exit then drops the flock.
libc.pthread_mutex_lock(ctypes.c_void_p(ctypes.addressof(ctypes.c_char.from_buffer(shared))))
os._exit(0)
"""



class LockHolder:
    """The election lock held by a small process of this engine's, so that
    the shadow wakes at the speed of the kill, however large this process.

    The kernel drops a dead process's flock only when it closes its files,
    after it has freed its memory: about 100 ms per GiB of resident memory.
    An engine of gigabytes that holds the lock itself wakes its shadow that
    much late. Here a fresh, tiny interpreter (the holder) takes the flock
    on the engine's behalf and exits the moment the engine dies:

    - the engine owns a robust, process-shared mutex (in a memfd both map)
      from a thread of its own that lives as long as the process; the
      holder, once it has the flock, waits on that mutex. When the engine
      dies, the kernel marks the mutex's owner dead and wakes the holder
      before it frees the engine's memory (a dying thread's robust futex
      list is walked first), so the holder exits, and the lock is free,
      in milliseconds;
    - the holder has ``PR_SET_PDEATHSIG(SIGKILL)`` and reads EOF from its
      socket if the engine dies before asking for the lock.

    Should the holder die on its own while it holds the lock (a kill of
    its pid alone), the lock is free and the shadow may be serving: the
    helper then ends this engine (SIGKILL), as a lost election must.

    The holder is the engine's child, in its container's cgroup: the
    runtime, which finds who holds the lock by the holder's cgroup, sees
    this engine's slot holding it.

    ``start()`` spawns the holder (a few tens of milliseconds); call it
    first thing, before heavy imports, from any thread: the holder is
    spawned by, and its mutex owned by, a thread of the helper's own that
    never ends (``PR_SET_PDEATHSIG`` fires when the spawning thread ends).
    The holder waits to be asked: ``acquire()`` asks it to take the lock
    and waits until it has it, pinging a watchdog meanwhile; from then on
    the lock is held until this process dies, execs, or ``release()``s.
    """

    def __init__(self, path=None):
        self.path = path or os.environ.get("SHADOW_LOCK_PATH", "/run/shadow/pair/engine.lock")
        self.held = False
        self._owner = None  # the pid that started it
        self._proc = None
        self._link = None
        self._shared = None
        self._asked = False
        self._let_go = threading.Event()
        self._thread = None
        self._state = threading.Lock()  # held, against the holder's exit
        self._gone = False

    @property
    def pid(self):
        """The holder process's pid, or None before ``start()``."""
        return self._proc.pid if self._proc is not None else None

    def start(self):
        """Spawns the holder (idempotent). Returns self."""
        if self._proc is not None and self._owner == os.getpid():
            return self
        import ctypes
        import subprocess
        import sys

        if not sys.executable:
            raise OSError("LockHolder: no sys.executable to run the holder with")
        libc = ctypes.CDLL(None, use_errno=True)
        memfd = os.memfd_create("shadow-lock-holder", os.MFD_CLOEXEC)
        try:
            os.ftruncate(memfd, 4096)
            shared = mmap.mmap(memfd, 4096)
            mutex = ctypes.c_void_p(ctypes.addressof(ctypes.c_char.from_buffer(shared)))
            attr = ctypes.create_string_buffer(64)
            for call, args in [("pthread_mutexattr_init", (attr,)),
                               ("pthread_mutexattr_setpshared", (attr, 1)),  # PTHREAD_PROCESS_SHARED
                               ("pthread_mutexattr_setrobust", (attr, 1)),  # PTHREAD_MUTEX_ROBUST
                               ("pthread_mutex_init", (mutex, attr))]:
                rc = getattr(libc, call)(*args)
                if rc != 0:
                    raise OSError(rc, f"LockHolder: {call}: {os.strerror(rc)}")
            ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            ready = threading.Event()
            let_go = self._let_go
            failed = []

            def own():
                # This thread owns the mutex and is the holder's parent (its
                # PDEATHSIG fires when this thread ends): it lives as long
                # as the holder, which ends at release() or with the engine.
                rc = libc.pthread_mutex_lock(mutex)
                if rc != 0:
                    failed.append(OSError(rc, f"LockHolder: pthread_mutex_lock: {os.strerror(rc)}"))
                    ready.set()
                    return
                try:
                    self._proc = subprocess.Popen(
                        [sys.executable, "-I", "-S", "-c", _HOLDER, str(theirs.fileno()), str(memfd),
                         str(os.getpid()), self.path],
                        pass_fds=(theirs.fileno(), memfd), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
                except BaseException as e:  # handed to start()
                    failed.append(e)
                    libc.pthread_mutex_unlock(mutex)
                    ready.set()
                    return
                ready.set()
                # The one reaper of the holder. A holder gone while it held
                # the lock, unasked, has freed it: the shadow may serve
                # already, and this engine must not go on serving beside it.
                self._proc.wait()
                with self._state:
                    self._gone = True
                    lost = self.held and not let_go.is_set()
                if lost:
                    os.write(2, f"LockHolder: the holder of {self.path} (pid {self._proc.pid}) died "
                                f"({self._proc.returncode}): the lock is lost, ending this engine\n".encode())
                    os.kill(os.getpid(), signal.SIGKILL)
                libc.pthread_mutex_unlock(mutex)

            self._thread = threading.Thread(target=own, name="shadow-lock-holder", daemon=True)
            self._thread.start()
            ready.wait()
            theirs.close()
            if failed:
                ours.close()
                raise failed[0]
        finally:
            os.close(memfd)
        self._owner = os.getpid()
        self._link, self._shared = ours, shared
        return self

    def acquire(self, watchdog=None, timeout=None):
        """Asks the holder to take the lock and blocks until it has it:
        this engine is then the active one. Starts the holder first if
        ``start()`` was not called. Returns self.

        With an enabled ``watchdog`` (as ``FailoverLock.acquire``) the
        parked engine pings while it waits, at each timeout of
        ``watchdog.wait()``; the wait ends the moment the holder says it
        has the lock. With ``timeout`` (seconds) a lock still not taken by
        then raises TimeoutError; the holder is ended, and a later
        ``acquire()`` starts a new one. OSError when the holder could not
        take the lock (its error) or died.
        """
        if self._owner is not None and self._owner != os.getpid():
            raise OSError("LockHolder: acquire() in a process other than the one that started the holder")
        if self.held:
            return self
        self.start()
        if not self._asked:
            self._link.sendall(b"G")
            self._asked = True
        deadline = None if timeout is None else time.monotonic() + timeout
        pinging = watchdog is not None and watchdog.enabled
        while True:
            waits = [w for w in (watchdog.wait() if pinging else None,
                                 None if deadline is None else max(0.0, deadline - time.monotonic()))
                     if w is not None]
            self._link.settimeout(min(waits) if waits else None)
            try:
                said = self._link.recv(512)
            except (TimeoutError, BlockingIOError):
                if pinging:
                    watchdog.ping()
                if deadline is not None and time.monotonic() >= deadline:
                    self._end()
                    raise TimeoutError(f"LockHolder: {self.path} not taken within {timeout} s")
                continue
            if said.startswith(b"L"):
                with self._state:
                    if not self._gone:  # else the holder died right after saying so
                        self.held = True
                        return self
            status = self._end()
            if said.startswith(b"E"):
                errno_text, _, text = said[1:].partition(b" ")
                raise OSError(int(errno_text or 0), f"LockHolder: flock {self.path}: {text.decode(errors='replace')}")
            raise OSError(f"LockHolder: the holder of {self.path} died before taking it (status {status})")

    def release(self):
        """Lets go of the lock (the holder exits); a no-op if not started,
        or in a process other than the one that started it."""
        if self._owner == os.getpid():
            self._end()

    def _end(self):
        """Ends the holder (a SIGKILL: it is small, so its flock goes at
        once) and reaps it, then lets the mutex go; returns the holder's
        exit status (negative: the signal that ended it)."""
        status = None
        self._let_go.set()
        if self._proc is not None:
            try:
                self._proc.kill()
            except ProcessLookupError:
                pass  # already reaped
        if self._thread is not None:
            self._thread.join()
        if self._proc is not None:
            status = self._proc.returncode
        if self._link is not None:
            self._link.close()
        self.held, self._asked = False, False
        self._proc = self._link = self._thread = self._owner = self._shared = None
        self._let_go = threading.Event()
        self._gone = False
        return status


LISTEN_FDS_START = 3
_inherited = None
_inherited_store = []


def _is_store_fd(fd):
    """Whether an inherited descriptor is one of the fd store's (handed
    after the listening sockets): a memfd, or a connected stream socket
    (an accepted connection), rather than a socket to accept or receive on."""
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            return True
        with socket.socket(fileno=os.dup(fd)) as s:
            if s.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                return False
            if s.type != socket.SOCK_STREAM:
                return False
            try:
                s.getpeername()
            except OSError:
                return False
            return True
    except OSError:
        return False


def _take_inherited():
    global _inherited, _inherited_store
    if _inherited is not None:
        return
    _inherited, _inherited_store = [], []
    try:
        if int(os.environ.get("LISTEN_PID", "")) != os.getpid():
            return
        n = int(os.environ.get("LISTEN_FDS", ""))
    except ValueError:
        return
    names = os.environ.get("LISTEN_FDNAMES", "").split(":")
    for i in range(max(0, min(n, 16384))):
        fd = LISTEN_FDS_START + i
        name = names[i] if i < len(names) and names[i] else "unknown"
        try:
            os.set_inheritable(fd, False)
        except OSError:
            continue  # not open
        if _is_store_fd(fd):
            _inherited_store.append((name, fd))
            continue
        try:
            _inherited.append((name, socket.socket(fileno=fd)))
        except OSError:
            continue


def listen_sockets():
    """The listening sockets this process inherited, ``[(name, socket.socket)]``.

    As ``sd_listen_fds(3)``: none unless LISTEN_PID is this process's pid and
    LISTEN_FDS a count; then descriptors 3.. are taken (made
    non-inheritable) and wrapped once; later calls return the same sockets.
    A parked engine holds them but must not ``accept`` before it is active.
    The fd store's descriptors that come after them (memfds, accepted
    connections) are not among them: ``fdstore_inherited()`` has those.
    """
    _take_inherited()
    return list(_inherited)


def fdstore_inherited():
    """The fd store's descriptors handed at this engine's start, after the
    listening sockets, ``[(name, fd)]``; the first call's caller owns them
    (later calls return none). An engine that fetches the store when it
    takes over closes these at once: a parked engine holding copies of
    every stored connection would keep each open after the serving engine
    is done with it."""
    global _inherited_store
    _take_inherited()
    out, _inherited_store = _inherited_store, []
    return out


def listen_socket(name=None):
    """The first inherited listening socket (or the one named ``name``, e.g.
    ``tcp-8000``), or None: then the engine binds its own port."""
    for n, sock in listen_sockets():
        if name is None or n == name:
            return sock
    return None


FDSTORE_SOCKET = "SHADOW_FDSTORE_SOCKET"
# The fetch protocol's bounds (shadow_contract::fdstore).
_FDS_PER_PACKET = 64
_PACKET_MAX = _FDS_PER_PACKET * 256 + 64


def _valid_fdname(name):
    return 0 < len(name) <= 255 and all(0x20 <= ord(c) < 0x7F and c != ":" for c in name)


def fdstore_store(fds, name, poll=True, path=None, timeout=1.0):
    """Stores the descriptors ``fds`` (ints or objects with ``fileno()``)
    in the pair's fd store under ``name`` (sd_notify's ``FDSTORE=1``,
    ``FDNAME=``; ``poll=False`` sends ``FDPOLL=0``: keep a socket whose peer
    hung up). Only sockets and memfds are kept. Returns False when there is
    no NOTIFY_SOCKET; waits up to ``timeout`` seconds for room."""
    if not _valid_fdname(name):
        raise ValueError(f"FDNAME {name!r}: 1 to 255 printable ASCII characters, no ':'")
    lines = ["FDSTORE=1", f"FDNAME={name}"] + ([] if poll else ["FDPOLL=0"])
    return _notify_with_fds(lines, [f if isinstance(f, int) else f.fileno() for f in fds], path, timeout)


def fdstore_remove(name, path=None, timeout=1.0):
    """Drops every descriptor stored under ``name`` (``FDSTOREREMOVE=1``)."""
    return _notify_with_fds(["FDSTOREREMOVE=1", f"FDNAME={name}"], [], path, timeout)


def _notify_with_fds(lines, fds, path, timeout):
    path = path or os.environ.get("NOTIFY_SOCKET")
    if not path:
        return False
    if path.startswith("@"):
        path = "\0" + path[1:]
    msg = ("\n".join(lines) + "\n").encode()
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
    global _sender
    with _sender_lock:
        # One socket per process, made once: a store right after an accept
        # is then one sendmsg (a connection accepted and not yet stored
        # dies with its engine). A forked child makes its own.
        if _sender is None or _sender[0] != os.getpid():
            _sender = (os.getpid(), socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC))
        s = _sender[1]
        s.settimeout(timeout)
        s.sendmsg([msg], anc, 0, path)
    return True


_sender = None
_sender_lock = threading.Lock()


# struct tcp_info (linux/tcp.h): 8 one-byte fields, 24 u32s, then
# tcpi_pacing_rate and tcpi_max_pacing_rate (u64) before tcpi_bytes_acked.
_TCPI_BYTES_ACKED = 8 + 24 * 4 + 2 * 8
_SIOCOUTQ = 0x5411


# TCP states in which this side's FIN takes a sequence number (counted by
# SIOCOUTQ until acknowledged, by tcpi_bytes_acked after): FIN_WAIT1,
# FIN_WAIT2, TIME_WAIT, LAST_ACK, CLOSING.
_FIN_SENT = (4, 5, 6, 9, 11)


def _tcp_acked(s):
    info = s.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    if len(info) < _TCPI_BYTES_ACKED + 8:
        raise OSError("TCP_INFO has no tcpi_bytes_acked on this kernel")
    return info[0], int.from_bytes(info[_TCPI_BYTES_ACKED:_TCPI_BYTES_ACKED + 8], "little")


def bytes_written(sock):
    """How many bytes have been written to the accepted TCP connection
    ``sock`` (a socket or a descriptor) so far, by every process that held
    it: what the peer acknowledged (TCP_INFO's tcpi_bytes_acked) plus what
    is still queued (SIOCOUTQ), less this side's FIN if it was sent; read
    again until no ACK moved bytes between the two counts. A promoted
    engine resumes an answer the dead engine was writing right after this
    many bytes (shadow_engine_kit::tcp::bytes_written)."""
    fd = sock if isinstance(sock, int) else sock.fileno()
    with socket.socket(fileno=os.dup(fd)) as s:
        for _ in range(1000):
            _, before = _tcp_acked(s)
            queued = array.array("i", [0])
            fcntl.ioctl(fd, _SIOCOUTQ, queued, True)
            state, after = _tcp_acked(s)
            if before == after:
                fin = 1 if state in _FIN_SENT else 0
                return max(0, after + max(0, queued[0]) - fin)
    raise OSError("the socket's acknowledged count never stood still")


ACCEPT = "SHADOW_ACCEPT"
HANDOFF_PREFIX = "accepted."
_HANDOFF_MAX = len("FDNAME=") + 256


def _rights(anc):
    """The descriptors of a ``recvmsg``'s ancillary data (``SCM_RIGHTS``)."""
    fds = []
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            arr = array.array("i")
            arr.frombytes(data[: len(data) - len(data) % arr.itemsize])
            fds.extend(arr)
    return fds


def accepted_by_runtime(environ=None):
    """Whether the runtime accepts this pair's connections and hands them
    over (``shadow.dev/accept: runtime``: ``SHADOW_ACCEPT=runtime``): then
    ``listen_socket()`` is this engine's hand-off socket, read with
    ``handoff_receive``, not a socket to ``accept`` on."""
    return (os.environ if environ is None else environ).get(ACCEPT) == "runtime"


def is_accepted_name(name):
    """Whether a name of the store is that of a connection the runtime
    accepted (``accepted.<listener>.<n>``)."""
    return name.startswith(HANDOFF_PREFIX)


def handoff_receive(sock):
    """The next connection the runtime hands over on ``sock`` (a hand-off
    socket), ``(name, socket.socket)``: it is in the store already under
    ``name``; store a state memfd under the same name, and
    ``fdstore_remove(name)`` once done with it (the store's copy keeps it
    open until then). None once the runtime closed the socket (the pair
    ended). ValueError for a packet that is not one name and one
    descriptor (what came with it is closed)."""
    msg, anc, flags, _ = sock.recvmsg(_HANDOFF_MAX, socket.CMSG_SPACE(4 * 4))
    fds = _rights(anc)
    truncated = bool(flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC))
    if not msg and not fds and not truncated:
        return None
    line = msg.decode("utf-8", "replace")
    name = line[len("FDNAME="):-1] if line.startswith("FDNAME=") and line.endswith("\n") else None
    if truncated or len(fds) != 1 or name is None or not _valid_fdname(name):
        _close(fds)
        raise ValueError(f"a hand-off packet of {len(msg)} bytes with {len(fds)} descriptors: "
                         "not FDNAME=<name> and one connection")
    os.set_inheritable(fds[0], False)
    return name, socket.socket(fileno=fds[0])


class FdStoreError(Exception):
    """The fd store refused a fetch (``ERROR=``), or its answer broke the protocol."""


def fdstore_fetch(path=None, timeout=10.0):
    """The whole fd store, ``[(name, fd)]`` (the caller owns each fd), for
    the engine that holds the election lock; call it right after taking the
    lock. None when the pair has no store (no SHADOW_FDSTORE_SOCKET)."""
    path = path or os.environ.get(FDSTORE_SOCKET)
    if not path:
        return None
    out = []
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC) as s:
        s.settimeout(timeout)
        s.connect(path)
        try:
            while True:
                msg, anc, flags, _ = s.recvmsg(_PACKET_MAX, socket.CMSG_SPACE(_FDS_PER_PACKET * 4))
                fds = _rights(anc)
                for fd in fds:
                    os.set_inheritable(fd, False)
                line = msg.decode("utf-8", "replace").rstrip("\n")
                if flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC):
                    _close(fds)
                    raise FdStoreError("a packet or its descriptors did not fit")
                if line.startswith("FDNAMES="):
                    names = line[len("FDNAMES="):].split(":")
                    if len(names) != len(fds):
                        _close(fds)
                        raise FdStoreError(f"{len(names)} names for {len(fds)} descriptors")
                    out.extend(zip(names, fds))
                elif line.startswith("END="):
                    _close(fds)
                    if line[4:] != str(len(out)):
                        raise FdStoreError(f"{line} after {len(out)} descriptors")
                    return out
                elif line.startswith("ERROR="):
                    _close(fds)
                    raise FdStoreError(f"the fd store refused: {line[6:]}")
                else:
                    _close(fds)
                    raise FdStoreError(f"unknown packet {line!r}")
        except BaseException:
            _close([fd for _, fd in out])
            raise


def _close(fds):
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


WATCHDOG_USEC = "WATCHDOG_USEC"
WATCHDOG_PID = "WATCHDOG_PID"


def _digits(value):
    """A number of decimal digits only (no sign, no space), else None."""
    if value is None or not value or not all("0" <= c <= "9" for c in value):
        return None
    return int(value)


def watchdog_interval(environ=None, pid=None):
    """The watchdog's interval in seconds, or None when this process has none.

    As ``sd_watchdog_enabled(3)`` reads it (and shadow_engine_kit::watchdog):
    WATCHDOG_USEC of digits only and more than zero, WATCHDOG_PID unset or
    this process's pid. Under the shim WATCHDOG_PID is 1, the engine's main
    process; its ranks and helpers inherit the variables and get None.
    """
    environ = os.environ if environ is None else environ
    pid = os.getpid() if pid is None else pid
    if WATCHDOG_PID in environ and _digits(environ[WATCHDOG_PID]) != pid:
        return None
    usec = _digits(environ.get(WATCHDOG_USEC))
    if not usec or usec >= 1 << 64:
        return None
    return usec / 1e6


class Watchdog:
    """Paces an engine's ``WATCHDOG=1`` pings: one each half interval
    (systemd's advice), the first at the first chance, which arms the
    runtime's watchdog.

    Disabled (``enabled`` False, ``interval`` None) when the process has no
    watchdog: ``ping()`` then sends nothing and ``wait()`` is None, which
    ``select`` and ``Event.wait`` take as "no timeout". Call ``ping()`` from
    the loops that do the work: it sends only when a ping is due.
    """

    def __init__(self, environ=None, pid=None, clock=time.monotonic):
        environ = os.environ if environ is None else environ
        self.interval = watchdog_interval(environ, pid)
        self._path = environ.get("NOTIFY_SOCKET")
        self._clock = clock
        self._last = None

    @property
    def enabled(self):
        return self.interval is not None

    def wait(self, now=None):
        """Seconds until the next ping is due (0 when it is), for a select or
        poll timeout; None when disabled."""
        if not self.enabled:
            return None
        if self._last is None:
            return 0.0
        now = self._clock() if now is None else now
        return max(0.0, self._last + self.interval / 2 - now)

    def due(self, now=None):
        """Whether a ping is due now (never while disabled)."""
        return self.enabled and self.wait(now) == 0

    def ping(self, now=None):
        """Sends ``WATCHDOG=1`` if a ping is due; returns whether it sent one.

        It never blocks: a full notify socket loses the ping rather than
        stall the loop that sends it. A send that fails (no NOTIFY_SOCKET, a
        full socket, one that refused it) counts as this period's ping all
        the same, so that a loop whose timeout is ``wait()`` does not spin."""
        now = self._clock() if now is None else now
        if not self.due(now):
            return False
        self._last = now
        try:
            return notify("WATCHDOG=1", path=self._path, block=False)
        except OSError:
            return False

    def trigger(self):
        """Sends ``WATCHDOG=trigger``: the runtime ends the engine at once
        (an engine that knows it is broken). Returns whether it sent."""
        try:
            return notify("WATCHDOG=trigger", path=self._path)
        except OSError:
            return False


def extend_start(seconds, path=None):
    """Sends ``EXTEND_TIMEOUT_USEC=``: an engine still starting (neither
    parked nor serving) asks for ``seconds`` more before the start timeout
    ends it. As in systemd, once past the original timeout it must send
    again within that time. Returns whether a datagram was sent."""
    usec = int(seconds * 1e6)
    if usec <= 0:
        raise ValueError(f"extend_start: {seconds!r} is not a positive number of seconds")
    try:
        return notify(f"EXTEND_TIMEOUT_USEC={usec}", path=path)
    except OSError:
        return False


class Progress:
    """Which ranks of a group advanced since the last ping.

    The group's main process marks a rank when it reports progress and
    pings only when ``watchdog.due() and progress.all_advanced()``, then
    ``reset()``s: a rank stuck in a collective or a kernel stops reporting,
    so the pings stop and the runtime ends the whole group. A rank out of
    range changes nothing.
    """

    def __init__(self, ranks):
        self._advanced = [False] * ranks

    @property
    def ranks(self):
        return len(self._advanced)

    def advanced(self, rank):
        if 0 <= rank < len(self._advanced):
            self._advanced[rank] = True

    def all_advanced(self):
        return all(self._advanced)

    def reset(self):
        self._advanced = [False] * len(self._advanced)
