"""shadow_gms: GPU Memory Service helpers for PyTorch engines.

Engine authors use three things from here:

- ``Gms``: a connection to the GMS daemon of one GPU (through libgms).
  The writer loads weights into GMS memory through a ``torch.cuda.MemPool``
  bound to libgms's pluggable allocator (``Gms.weights_pool()``) and commits
  them with tensor metadata (``Gms.commit_module``); a reader rebuilds the
  same tensors, zero-copy, at the writer's addresses (``Gms.load_module``).
- ``Gms.kv_cache(bytes)``: a KV cache whose addresses are reserved now and
  whose pages are backed only on promotion: ``wake()`` returns at once and
  the cache grows as the device's memory allows (``backed``, ``wait``).
- ``FailoverLock`` and ``notify``: the engine contract of docs/engine-contract.md
  (flock on SHADOW_LOCK_PATH, STATUS=parked / READY=1 on NOTIFY_SOCKET).
  ``LockHolder``: the lock held by a small process of the engine's, so that
  a large engine's death frees it in milliseconds (``start()`` early,
  ``acquire()`` when parked).
- ``Watchdog``, ``Progress`` and ``extend_start``: the watchdog's pings
  (``shadow.dev/watchdog``: WATCHDOG_USEC) from the loops that work, and
  more time before the start timeout (EXTEND_TIMEOUT_USEC).
- ``listen_socket()``: the pair's listening socket when the runtime hands
  one down (``shadow.dev/listen``: LISTEN_FDS), else None.
- ``fdstore_store``, ``fdstore_remove``, ``fdstore_fetch``: the pair's fd
  store (``FDSTORE=1``): descriptors that outlive the engine, fetched by
  the engine that takes over (``fdstore_inherited``: those handed at
  start; ``bytes_written``: how much of an answer a connection has).
- ``accepted_by_runtime``, ``handoff_receive``, ``is_accepted_name``: when
  the runtime accepts (``shadow.dev/accept: runtime``), the connections it
  hands over on the engine's hand-off socket.
- ``Gms.verify_weights()``: the digest its writer recorded at commit,
  recomputed on the GPU; a promoted engine calls it before ``READY=1`` and
  exits with ``CORRUPT_EXIT`` on ``WeightsCorrupt``.

Only torch and the standard library are needed; the contract helpers
(``FailoverLock``, ``LockHolder``, ``notify``, ``listen_socket``, ``Watchdog``,
``Progress``, ``extend_start``) need no torch.
"""

from .contract import (CORRUPT_EXIT, FailoverLock, FdStoreError, LockHolder, bytes_written, Progress, Watchdog,
                       accepted_by_runtime, extend_start, fdstore_fetch, fdstore_inherited, fdstore_remove,
                       fdstore_store, handoff_receive, is_accepted_name, listen_socket, listen_sockets, notify,
                       watchdog_interval)

_CLIENT = ("Gms", "GmsError", "KvCache", "KvPool", "WeightsCorrupt", "find_library", "reserved_device_tensor")


def __getattr__(name):
    # The GMS client needs torch; the contract helpers (lock, notify, the
    # inherited socket) need only the standard library, so an engine without
    # torch can use them.
    if name in _CLIENT:
        from . import client

        return getattr(client, name)
    raise AttributeError(f"module 'shadow_gms' has no attribute {name!r}")


__all__ = ["CORRUPT_EXIT", "FailoverLock", "Gms", "GmsError", "KvCache", "KvPool", "LockHolder", "Progress", "Watchdog",
           "WeightsCorrupt", "extend_start", "fdstore_fetch", "fdstore_inherited", "fdstore_remove", "fdstore_store",
           "FdStoreError", "bytes_written", "find_library", "listen_socket", "listen_sockets", "notify", "watchdog_interval",
           "accepted_by_runtime", "handoff_receive", "is_accepted_name", "reserved_device_tensor"]
