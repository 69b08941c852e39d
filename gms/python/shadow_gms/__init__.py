"""shadow_gms: GPU Memory Service helpers for PyTorch engines.

Engine authors use three things from here:

- ``Gms``: a connection to the GMS daemon of one GPU (through libgms).
  The writer loads weights into GMS memory through a ``torch.cuda.MemPool``
  bound to libgms's pluggable allocator (``Gms.weights_pool()``) and commits
  them with tensor metadata (``Gms.commit_module``); a reader rebuilds the
  same tensors, zero-copy, at the writer's addresses (``Gms.load_module``).
- ``Gms.kv_cache(bytes)``: a KV cache whose addresses are reserved now and
  whose pages are materialised only on promotion.
- ``FailoverLock`` and ``notify``: the engine contract of docs/engine-contract.md
  (flock on SHADOW_LOCK_PATH, STATUS=parked / READY=1 on NOTIFY_SOCKET).

Only torch and the standard library are needed.
"""

from .contract import FailoverLock, notify
from .client import Gms, GmsError, KvCache, find_library

__all__ = ["FailoverLock", "Gms", "GmsError", "KvCache", "find_library", "notify"]
