"""What a killed vLLM leaves in /dev/shm, named so the next engine of its
slot can remove it.

Why: vLLM's processes share ring buffers through POSIX shared memory
(``multiprocessing.shared_memory``: /dev/shm/psm_*, hundreds of MiB each
on the CPU build) and take multiprocessing semaphores (/dev/shm/sem.mp-*).
A clean exit removes them (multiprocessing's resource tracker); a SIGKILL
of the engine kills the tracker too, and they stay. Where /dev/shm
outlives the engine (a pod's, shared by the pair's containers) every
failover would leave another ~400 MiB of tmpfs.

So each engine's processes name what they create after the engine's slot
and start (``psm_shadow<slot>_<boot>_<hex>``, ``sem.mp-shadow<slot>_<boot>-…``),
and an engine starting in a slot removes every such file of that slot
first: the runtime starts an engine in a slot only once the one before it
there is dead. An engine without SHADOW_ENGINE_ID (not in a pair) names
nothing and removes nothing.
"""

import os
import secrets

TAG_VAR = "SHADOW_VLLM_SHM_TAG"
SHM_DIR = "/dev/shm"
# At most 3 shadows (shadow.dev/shadows): slots 0..3; a few more digits
# cost nothing.
_MAX_SLOT_DIGITS = 4


def slot_of(environ=None):
    """SHADOW_ENGINE_ID when it is a slot number, else None."""
    environ = os.environ if environ is None else environ
    v = environ.get("SHADOW_ENGINE_ID", "")
    if not v or len(v) > _MAX_SLOT_DIGITS or not all("0" <= c <= "9" for c in v):
        return None
    return int(v)


def _prefixes(slot):
    return (f"psm_shadow{slot}_", f"sem.mp-shadow{slot}_")


def reclaim(slot, shm_dir=SHM_DIR):
    """Removes every file of ``slot``'s earlier engines from ``shm_dir``;
    returns their names. Nothing else is touched."""
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return []
    removed = []
    for name in names:
        if name.startswith(_prefixes(slot)):
            try:
                os.unlink(os.path.join(shm_dir, name))
                removed.append(name)
            except FileNotFoundError:
                pass
            except OSError:
                continue
    return sorted(removed)


def new_tag(slot):
    return f"shadow{slot}_{secrets.token_hex(4)}"


def apply(tag):
    """Names this process's new shared memory and semaphores after ``tag``
    (call in each process: what a process sets is not inherited by the
    processes it spawns). Stdlib only: multiprocessing's own naming."""
    from multiprocessing import process, shared_memory

    def make_filename():
        return f"/psm_{tag}_{secrets.token_hex(4)}"

    shared_memory._make_filename = make_filename
    process.current_process()._config["semprefix"] = f"/mp-{tag}"


def setup(environ=None, shm_dir=SHM_DIR):
    """In the engine's main process, before vLLM starts anything: removes
    the slot's leftovers, makes this engine's tag, names this process's
    files by it and leaves it in the environment for vLLM's processes
    (``apply_inherited``). Returns (tag, removed), or (None, []) outside a
    pair."""
    environ = os.environ if environ is None else environ
    slot = slot_of(environ)
    if slot is None:
        return None, []
    removed = reclaim(slot, shm_dir)
    tag = new_tag(slot)
    environ[TAG_VAR] = tag
    apply(tag)
    return tag, removed


def apply_inherited(environ=None):
    """In vLLM's other processes: the engine's tag, if its main process
    made one."""
    environ = os.environ if environ is None else environ
    tag = environ.get(TAG_VAR)
    if tag and tag.startswith("shadow") and all(c.isalnum() or c == "_" for c in tag):
        apply(tag)
