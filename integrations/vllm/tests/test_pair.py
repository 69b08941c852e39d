"""shadow_vllm's contract side against stand-ins for the runtime (a notify
socket, a lock file, a pre-bound listening socket), with no vLLM:
``python -m unittest discover -s integrations/vllm/tests``
(``make test-vllm-unit``).

The engine under test is a real process running ``shadow_vllm.pair`` as
``shadow-vllm serve`` does, with a two-line server in place of vLLM's.
Every wait is bounded by a timeout only a broken engine reaches; nothing
asserts how long something took.
"""

import fcntl
import os
import queue
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
PKG = os.path.dirname(HERE)
GMS = os.path.join(PKG, "..", "..", "gms", "python")
sys.path[:0] = [PKG, GMS]

from shadow_vllm import cli, parentwatch, vllm_glue  # noqa: E402
from shadow_vllm.pair import MAIN_PID_VAR, Pair  # noqa: E402

LIMIT_S = 30
PYTHONPATH = os.pathsep.join([PKG, os.path.abspath(GMS)])

# The engine: shadow-vllm serve's order with a stand-in server. It reports
# what it saw on stdout, one line each.
ENGINE = textwrap.dedent(
    """
    import os, sys
    from shadow_gms import contract
    from shadow_vllm.pair import Pair
    pair = Pair.from_environ()
    pair.check()
    print("env", ",".join(v for v in ("LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES") if v in os.environ),
          os.environ.get("SHADOW_VLLM_MAIN_PID") == str(os.getpid()), flush=True)
    print("listen", pair.listen_name, pair.listen is not None, flush=True)
    pair.park(contract.Watchdog())
    print("active", flush=True)
    conn, _ = pair.listen.accept()
    pair.ready()
    conn.sendall(b"served by " + os.environ["SHADOW_ENGINE_ID"].encode())
    conn.close()
    print("done", flush=True)
    """
)


def accept_queue(listener):
    """Connections waiting in a listening TCP socket's accept queue
    (TCP_INFO's tcpi_unacked is the queue's length on a listener)."""
    info = listener.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 104)
    # struct tcp_info: 8 bytes of u8 fields, then u32 rto, ato, snd_mss,
    # rcv_mss, unacked.
    return struct.unpack_from("I", info, 8 + 4 * 4)[0]


def lock_waiters(path):
    """Pids waiting for a flock on ``path`` (``->`` lines of /proc/locks):
    how the runtime, too, sees an engine blocked on the election lock."""
    st = os.stat(path)
    dev = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    pids = []
    with open("/proc/locks") as f:
        for row in f:
            fields = row.split()
            if len(fields) > 6 and fields[1] == "->" and fields[2] == "FLOCK" and fields[6] == dev:
                pids.append(int(fields[5]))
    return pids


def wait_for(what, pred, timeout=LIMIT_S, step=0.01):
    """Polls ``pred`` until it returns something true; fails the test,
    naming ``what``, after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        got = pred()
        if got:
            return got
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what}")
        time.sleep(step)


class Runtime:
    """The runtime's side: notify socket, lock file, listening socket."""

    def __init__(self, test):
        d = tempfile.TemporaryDirectory()
        test.addCleanup(d.cleanup)
        self.dir = d.name
        self.notify_path = os.path.join(d.name, "notify.sock")
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        test.addCleanup(self.notify.close)
        self.notify.bind(self.notify_path)
        self.lock_path = os.path.join(d.name, "engine.lock")
        open(self.lock_path, "w").close()
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        test.addCleanup(self.listener.close)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        self.procs = []
        test.addCleanup(self.kill_all)

    def kill_all(self):
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait(LIMIT_S)
            p.stdout.close()

    def start(self, slot, watchdog_usec=None):
        env = dict(os.environ, PYTHONPATH=PYTHONPATH, SHADOW_ENGINE_ID=str(slot),
                   SHADOW_LOCK_PATH=self.lock_path, NOTIFY_SOCKET=self.notify_path,
                   LISTEN_FDS="1", LISTEN_FDNAMES="tcp-%d" % self.port)
        env.pop("WATCHDOG_PID", None)
        env.pop("WATCHDOG_USEC", None)
        if watchdog_usec:
            env["WATCHDOG_USEC"] = str(watchdog_usec)
        fd = self.listener.fileno()
        # As the runtime hands it: descriptor 3, and LISTEN_PID the engine's
        # own pid (a shell that execs python keeps its pid: $$).
        cmd = ["/bin/sh", "-c", f'LISTEN_PID=$$ exec "$0" -c "$1" 3<&{fd}', sys.executable, ENGINE]
        p = subprocess.Popen(cmd, env=env, pass_fds=(fd,), stdout=subprocess.PIPE, text=True)
        self.procs.append(p)
        return p

    def datagrams(self, until, timeout=LIMIT_S):
        """Datagrams until one equal to ``until`` (that one included)."""
        out = []
        self.notify.settimeout(timeout)
        while True:
            msg = self.notify.recv(4096).decode()
            out.append(msg)
            if msg == until:
                return out


def line(proc):
    return proc.stdout.readline().strip()


class ParkThenServe(unittest.TestCase):
    def test_parks_without_accepting_then_serves_the_queued_connection(self):
        rt = Runtime(self)
        holder = os.open(rt.lock_path, os.O_RDONLY)
        self.addCleanup(lambda: holder is not None and os.close(holder))
        fcntl.flock(holder, fcntl.LOCK_EX)

        engine = rt.start(1)
        self.assertEqual(line(engine), "env  True", "the socket-activation variables must be gone")
        self.assertEqual(line(engine), f"listen tcp-{rt.port} True")
        self.assertEqual(rt.datagrams("STATUS=parked"), ["STATUS=parked"])

        client = socket.create_connection(("127.0.0.1", rt.port), timeout=LIMIT_S)
        self.addCleanup(client.close)
        # Parked: blocked on the lock (its own process or its lock helper),
        # and the connection waits in the kernel's queue, not accepted.
        wait_for("the engine blocked on the election lock", lambda: lock_waiters(rt.lock_path))
        self.assertEqual(accept_queue(rt.listener), 1, "a parked engine accepted")

        os.close(holder)  # the active engine dies
        holder = None
        self.assertEqual(line(engine), "active")
        self.assertEqual(client.recv(100), b"served by 1")
        self.assertEqual(rt.datagrams("READY=1\nSTATUS=serving"), ["READY=1\nSTATUS=serving"])
        self.assertEqual(line(engine), "done")
        self.assertEqual(engine.wait(LIMIT_S), 0)
        self.assertEqual(accept_queue(rt.listener), 0)

    def test_two_engines_one_serves_one_parks_and_takes_over(self):
        rt = Runtime(self)
        a = rt.start(0)
        self.assertEqual(line(a), "env  True")
        line(a)
        self.assertEqual(line(a), "active")
        b = rt.start(1)
        line(b)
        line(b)
        rt.datagrams("STATUS=parked", timeout=LIMIT_S)  # a's
        rt.datagrams("STATUS=parked", timeout=LIMIT_S)  # b's
        first = socket.create_connection(("127.0.0.1", rt.port), timeout=LIMIT_S)
        self.addCleanup(first.close)
        self.assertEqual(first.recv(100), b"served by 0")
        self.assertEqual(line(a), "done")
        a.wait(LIMIT_S)
        self.assertEqual(line(b), "active")
        second = socket.create_connection(("127.0.0.1", rt.port), timeout=LIMIT_S)
        self.addCleanup(second.close)
        self.assertEqual(second.recv(100), b"served by 1")

    def test_pings_the_watchdog_while_parked(self):
        rt = Runtime(self)
        holder = os.open(rt.lock_path, os.O_RDONLY)
        self.addCleanup(os.close, holder)
        fcntl.flock(holder, fcntl.LOCK_EX)
        engine = rt.start(1, watchdog_usec=100_000)
        line(engine)
        line(engine)
        got = rt.datagrams("WATCHDOG=1")
        self.assertIn("STATUS=parked", got)
        for _ in range(3):
            self.assertEqual(rt.datagrams("WATCHDOG=1"), ["WATCHDOG=1"])
        engine.kill()


class Refusals(unittest.TestCase):
    def test_runtime_accept_is_refused_with_a_reason(self):
        pair = Pair(lock_path="/x", accept_by_runtime=True)
        with self.assertRaises(SystemExit) as e:
            pair.check()
        self.assertIn("hand-off", str(e.exception))

    def test_no_contract_is_standalone(self):
        self.assertTrue(Pair().standalone)
        self.assertFalse(Pair(lock_path="/run/shadow/pair/engine.lock").standalone)


class PairDefaults(unittest.TestCase):
    """What shadow-vllm sets for vLLM in a pair unless the user did."""

    def test_a_pair_unbinds_the_cpu_threads(self):
        environ = {"SHADOW_LOCK_PATH": "/run/shadow/pair/engine.lock"}
        pair = Pair(lock_path=environ["SHADOW_LOCK_PATH"])
        self.assertEqual(cli.pair_defaults(pair, environ), {"VLLM_CPU_OMP_THREADS_BIND": "nobind"})
        self.assertEqual(environ["VLLM_CPU_OMP_THREADS_BIND"], "nobind")

    def test_a_users_choice_is_kept(self):
        for chosen in ("0-3", "auto", ""):
            environ = {"VLLM_CPU_OMP_THREADS_BIND": chosen}
            self.assertEqual(cli.pair_defaults(Pair(lock_path="/x"), environ), {})
            self.assertEqual(environ, {"VLLM_CPU_OMP_THREADS_BIND": chosen})

    def test_plain_vllm_serve_is_left_alone(self):
        environ = {}
        self.assertEqual(cli.pair_defaults(Pair(), environ), {})
        self.assertEqual(environ, {})


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


class Recorder:
    """A Watchdog stand-in counting its pings (every call sends)."""

    enabled = True

    def __init__(self, interval=0.02):
        self.interval = interval
        self.pings = 0

    def wait(self):
        return self.interval

    def ping(self):
        self.pings += 1
        return True


class EngineCoreWatchdog(unittest.TestCase):
    """vllm_glue's wrap of EngineCoreProc._process_input_queue, on a stand-in
    busy loop (the wrap needs no vLLM; patch_engine_core applies it)."""

    def busy_loop(self, engine, process_input_queue, stop, step):
        while not stop.is_set():
            process_input_queue(engine)
            step()

    def test_an_idle_loop_pings_and_a_stuck_step_stops_the_pings(self):
        wd = Recorder()

        class Engine:
            input_queue = queue.Queue()

        def original(self):
            item = self.input_queue.get()  # blocks while idle, as vLLM's does
            self.last = item

        wrapped = vllm_glue.wrap_process_input_queue(original, lambda _e: wd)
        engine = Engine()
        engine.input_queue = queue.Queue()
        stop, stuck, release = threading.Event(), threading.Event(), threading.Event()

        def step():
            if getattr(engine, "last", None) == "hang":
                stuck.set()
                release.wait(LIMIT_S)

        t = threading.Thread(target=self.busy_loop, args=(engine, wrapped, stop, step), daemon=True)
        t.start()
        wait_for("an idle busy loop's pings", lambda: wd.pings >= 5)
        engine.input_queue.put("work")
        engine.input_queue.put("hang")
        self.assertTrue(stuck.wait(LIMIT_S))
        before = wd.pings
        # Not a wait for an event but the claim's window: no event says
        # "no ping"; ten intervals pass in which an idle loop pings ten times.
        time.sleep(10 * wd.interval)
        self.assertEqual(wd.pings, before, "a stuck step must stop the pings")
        stop.set()
        release.set()
        engine.input_queue.put("stop")
        t.join(LIMIT_S)

    def test_no_watchdog_leaves_the_queue_alone(self):
        class Off:
            enabled = False

        class Engine:
            pass

        engine = Engine()
        engine.input_queue = queue.Queue()
        engine.input_queue.put(1)
        wrapped = vllm_glue.wrap_process_input_queue(lambda self: self.input_queue.get(), lambda _e: Off())
        self.assertEqual(wrapped(engine), 1)
        self.assertIs(type(engine.input_queue), queue.Queue)

    def test_the_engine_core_pings_for_the_main_process(self):
        env = {"WATCHDOG_USEC": "2000000", "WATCHDOG_PID": "1", MAIN_PID_VAR: "1", "NOTIFY_SOCKET": "/x"}
        self.assertTrue(vllm_glue.engine_watchdog(env).enabled)
        env[MAIN_PID_VAR] = "7"  # the watchdog is some other process's
        self.assertFalse(vllm_glue.engine_watchdog(env).enabled)
        self.assertFalse(vllm_glue.engine_watchdog({"NOTIFY_SOCKET": "/x"}).enabled)


class ParentWatch(unittest.TestCase):
    def test_a_child_dies_with_its_parent(self):
        # parent -> child (watching); SIGKILL the parent: the child must go.
        code = textwrap.dedent(
            """
            import os, signal, subprocess, sys
            child = subprocess.Popen([sys.executable, "-c",
                "from shadow_vllm import parentwatch; parentwatch.start(); print('watching', flush=True);"
                "import signal; signal.pause()"], stdout=subprocess.PIPE, text=True)
            assert child.stdout.readline().strip() == "watching"
            print(child.pid, flush=True)
            signal.pause()  # until killed
            """
        )
        env = dict(os.environ, PYTHONPATH=PYTHONPATH)
        env.pop(MAIN_PID_VAR, None)
        parent = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
        self.addCleanup(parent.stdout.close)
        child = int(parent.stdout.readline())
        self.addCleanup(lambda: _kill_quietly(child))
        self.assertTrue(_alive(child))
        parent.kill()
        parent.wait(LIMIT_S)
        wait_for("the child gone with its parent", lambda: not _alive(child))

    def test_start_is_once_per_process(self):
        self.assertTrue(parentwatch.start())
        self.assertTrue(parentwatch.start())
        self.assertEqual(sum(t.name == "shadow-parent-watch" for t in threading.enumerate()), 1)


def _alive(pid):
    """Alive and not a zombie (a zombie has died; its parent is gone too,
    so init reaps it)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _kill_quietly(pid):
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


if __name__ == "__main__":
    unittest.main()
