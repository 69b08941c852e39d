"""The ``shadow-vllm`` command.

Why its own module: the order matters. The pair's listening socket and the
lock helper are taken before vLLM is imported (vLLM's import alone is
seconds and hundreds of megabytes, and it starts processes that must not
see the socket-activation variables), then vLLM parses ``vllm serve``'s
own arguments.
"""

import os
import sys

# What an engine of a pair runs with unless the user set it, and why.
PAIR_DEFAULTS = {
    # vLLM's CPU build binds each engine's OpenMP threads to cores of its
    # own choosing, the same ones in every engine of a machine (its
    # default, `auto`): a pair's two engines would share them, and the
    # serving engine's busy threads starve the parked one there (its
    # start, its move onto those cores) and a killed one's exit, for
    # minutes on a small machine. Unbound, the kernel spreads them.
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
}

USAGE = """usage: shadow-vllm serve MODEL [vllm serve's arguments]

Runs vLLM's OpenAI-compatible server as an engine of a shadow pair: fully
built and warmed up, parked behind SHADOW_LOCK_PATH, serving on the pair's
socket (LISTEN_FDS) once it holds the lock. Without SHADOW_LOCK_PATH and
LISTEN_FDS it is `vllm serve`. `shadow-vllm serve --help` lists vLLM's
arguments. In a pair, VLLM_CPU_OMP_THREADS_BIND is `nobind` unless set."""


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] != "serve":
        print(f"shadow-vllm: unknown command {argv[0]!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return serve(argv[1:])


def pair_defaults(pair, environ=None):
    """For an engine of a pair (not ``pair.standalone``), sets each of
    ``PAIR_DEFAULTS`` that ``environ`` (``os.environ``) does not have, and
    returns those it set. Called before vLLM is imported."""
    environ = os.environ if environ is None else environ
    if pair.standalone:
        return {}
    unset = {k: v for k, v in PAIR_DEFAULTS.items() if k not in environ}
    environ.update(unset)
    return unset


def serve(argv):
    from . import lock, shm
    from .pair import Pair, _log

    pair = Pair.from_environ()
    pair.check()
    for k, v in pair_defaults(pair).items():
        _log(f"{k}={v}: the default in a pair (set it to choose another)")
    lock.prepare()
    tag, removed = shm.setup()
    if removed:
        _log(f"removed {len(removed)} /dev/shm file(s) left by this slot's dead engine: {' '.join(removed)}")

    from . import vllm_glue

    vllm_glue.check_version()
    args = vllm_glue.parse_serve_args(argv)
    if pair.standalone:
        vllm_glue.run_plain(args)
    else:
        vllm_glue.run_pair(args, pair)
    return 0
