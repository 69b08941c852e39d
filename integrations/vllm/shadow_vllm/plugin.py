"""vLLM's general plugin (entry point ``vllm.general_plugins``: ``shadow``).

Why a plugin: vLLM loads it in each of its processes (API server,
EngineCore, workers), which is the only way in to the processes vLLM
starts. It does nothing unless the API server is a ``shadow-vllm serve``
(``SHADOW_VLLM_MAIN_PID`` set): installing shadow-vllm changes no plain
``vllm serve``. In a shadow-vllm engine it

- makes every process but the API server die with its parent
  (shadow_vllm.parentwatch), in this process and in those it forks;
- makes the EngineCore's busy loop ping the watchdog (WATCHDOG_USEC), so
  that a stuck step stops the pings (shadow_vllm.vllm_glue);
- names the process's /dev/shm files after the engine's slot, so that the
  next engine of the slot removes what a killed one left (shadow_vllm.shm).
"""

import os
import sys

from . import parentwatch, shm
from .pair import MAIN_PID_VAR

_registered_in = None


def register():
    global _registered_in
    main = os.environ.get(MAIN_PID_VAR)
    if main is None or _registered_in == os.getpid():
        return
    _registered_in = os.getpid()
    if str(os.getpid()) == main:
        os.register_at_fork(after_in_child=parentwatch._after_fork)
    else:
        parentwatch.start_here_and_in_forks()
        shm.apply_inherited()
    try:
        from . import vllm_glue

        vllm_glue.patch_engine_core()
    except Exception as e:  # vLLM logs and ignores a failing plugin: say why here
        print(f"shadow-vllm plugin: the EngineCore's watchdog pings are off: {e!r}", file=sys.stderr, flush=True)
        raise
