"""The engine contract's sequence for one vLLM server, without vLLM.

Why a module of its own: what a shadow-aware engine does around its server
(docs/engine-contract.md: take the pair's listening socket at start, say
``STATUS=parked``, block on the election lock while pinging the watchdog,
serve, say ``READY=1``) does not depend on vLLM, so it is written and
tested here against stand-in sockets and lock files, and
``shadow_vllm.vllm_glue`` only calls it at the right moments.

``Pair.from_environ()`` reads what the runtime gave this process; an engine
started without any of it (no SHADOW_LOCK_PATH, no LISTEN_FDS) is
``Pair.standalone``, and then shadow-vllm is plain ``vllm serve``.
"""

import os
import socket
import sys
import time

from shadow_gms import contract

from . import lock

# The variables of socket activation: taken once by this process, then
# removed, so that vLLM's own processes (EngineCore, workers) never read
# them as theirs (sd_listen_fds(3)'s unset_environment).
_LISTEN_VARS = ("LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES")

# Where this process's pid is left for vLLM's other processes: the general
# plugin (shadow_vllm.plugin) tells the API server from EngineCore and the
# workers by it, and pings the watchdog on the API server's behalf.
MAIN_PID_VAR = "SHADOW_VLLM_MAIN_PID"

# The backlog of the pair's socket (shadow_contract::listen): an asyncio or
# uvloop server calls listen(2) again on a socket it is given, which only
# sets the backlog; giving it the pair's own keeps the socket as it was.
PAIR_BACKLOG = 4096


def _log(msg):
    print(f"shadow-vllm: {msg}", file=sys.stderr, flush=True)


class Pair:
    """What the runtime handed this engine, and the contract's steps."""

    def __init__(self, lock_path=None, notify_path=None, listen=None, listen_name=None, accept_by_runtime=False):
        self.lock_path = lock_path
        self.notify_path = notify_path
        self.listen = listen
        self.listen_name = listen_name
        self.accept_by_runtime = accept_by_runtime
        self.lock = None
        self.parked = False
        self.locked_at = None  # time.monotonic() when the lock was taken

    @classmethod
    def from_environ(cls, environ=None):
        """Reads the contract's variables; takes the first listening socket
        (LISTEN_FDS, when LISTEN_PID is this process) and removes the
        socket-activation variables from ``os.environ``.

        Call it first thing, before vLLM starts a process: the descriptors
        are made close-on-exec here."""
        environ = os.environ if environ is None else environ
        accept_by_runtime = contract.accepted_by_runtime(environ)
        listen, name = None, None
        socks = contract.listen_sockets() if environ is os.environ else []
        if socks:
            name, listen = socks[0]
            for other_name, other in socks[1:]:
                _log(f"only the first listening socket is served; {other_name} is left alone")
                other.detach()
        # The fd store's descriptors handed at start: a parked engine must
        # not hold copies of the serving engine's connections.
        for _, fd in contract.fdstore_inherited() if environ is os.environ else []:
            try:
                os.close(fd)
            except OSError:
                pass
        if environ is os.environ:
            for var in _LISTEN_VARS:
                os.environ.pop(var, None)
            os.environ[MAIN_PID_VAR] = str(os.getpid())
        return cls(
            lock_path=environ.get("SHADOW_LOCK_PATH") or None,
            notify_path=environ.get("NOTIFY_SOCKET") or None,
            listen=listen,
            listen_name=name,
            accept_by_runtime=accept_by_runtime,
        )

    @property
    def standalone(self):
        """No lock and no inherited socket: plain ``vllm serve``."""
        return self.lock_path is None and self.listen is None

    def check(self):
        """Refuses what this integration does not do, with what to change."""
        if self.accept_by_runtime:
            raise SystemExit(
                "shadow-vllm: SHADOW_ACCEPT=runtime (shadow.dev/accept: runtime) hands connections over a "
                "hand-off socket, which vLLM's server cannot read: leave the pair's accept to the engine"
            )
        if self.listen is not None and self.listen.type != socket.SOCK_STREAM:
            raise SystemExit(
                f"shadow-vllm: the pair's socket {self.listen_name} is not a stream socket: "
                "vLLM's HTTP server needs shadow.dev/listen=tcp:… or unix:…"
            )

    def notify(self, *fields):
        """sd_notify on NOTIFY_SOCKET; a runtime that is gone is not fatal."""
        try:
            return contract.notify(*fields, path=self.notify_path)
        except OSError as e:
            _log(f"notify {fields!r} on {self.notify_path}: {e}")
            return False

    def park(self, watchdog=None):
        """``STATUS=parked``, then block until this engine holds the lock.

        With no lock path the engine is alone and serves at once. The
        watchdog (``contract.Watchdog``) is pinged while parked."""
        if self.lock_path is None:
            return
        self.parked = True
        self.notify("STATUS=parked")
        _log(f"parked: waiting for {self.lock_path} (held by {lock.holder_kind()})")
        self.lock = lock.acquire(self.lock_path, watchdog)
        self.locked_at = time.monotonic()
        self.parked = False
        _log("holding the lock")

    def ready(self):
        self.notify("READY=1", "STATUS=serving")
