"""The ``shadow-vllm`` command.

Why its own module: the order matters. The pair's listening socket and the
lock helper are taken before vLLM is imported (vLLM's import alone is
seconds and hundreds of megabytes, and it starts processes that must not
see the socket-activation variables), then vLLM parses ``vllm serve``'s
own arguments.
"""

import sys

USAGE = """usage: shadow-vllm serve MODEL [vllm serve's arguments]

Runs vLLM's OpenAI-compatible server as an engine of a shadow pair: fully
built and warmed up, parked behind SHADOW_LOCK_PATH, serving on the pair's
socket (LISTEN_FDS) once it holds the lock. Without SHADOW_LOCK_PATH and
LISTEN_FDS it is `vllm serve`. `shadow-vllm serve --help` lists vLLM's
arguments."""


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] != "serve":
        print(f"shadow-vllm: unknown command {argv[0]!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    return serve(argv[1:])


def serve(argv):
    from . import lock, shm
    from .pair import Pair, _log

    pair = Pair.from_environ()
    pair.check()
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
