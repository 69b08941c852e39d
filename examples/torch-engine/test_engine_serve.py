"""The torch engine's own serving path (engine.serve: lock, fetch, READY=1,
resume, the serving loop, OpenAI's completions) without a GPU: torch is
replaced by a stub module before engine.py is imported, and the model by a
fake ``generate``. The test plays the runtime: the election lock, a notify
socket that keeps what is stored, and a fetch socket that answers as the
shim does (FDNAMES=, END=). Engine A serves a stream and is SIGKILLed in
the middle of it; engine B, parked on the lock meanwhile, takes over and
finishes it: the client gets one whole stream, the same as an undisturbed
one."""

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from test_continuity import Runtime, events, post, read_all  # noqa: E402

# Seconds per token of the fake model.
TOKEN_S = 0.02

# Runs in the engine's process: a stub torch, then engine.serve.
ENGINE = r"""
import os, sys, time, types
here = sys.argv[1]
torch = types.ModuleType("torch")
torch.bfloat16 = None
torch.no_grad = lambda: (lambda f: f)
torch.nn = types.ModuleType("torch.nn")
torch.nn.Module = object
torch.nn.functional = types.ModuleType("torch.nn.functional")
sys.modules.update({"torch": torch, "torch.nn": torch.nn, "torch.nn.functional": torch.nn.functional})
sys.path.insert(0, here)
sys.path.insert(0, os.path.join(here, "..", "..", "gms", "python"))
# The GMS client (libgms through torch) is the GPU's: a stub of its names.
client = types.ModuleType("shadow_gms.client")
class WeightsCorrupt(Exception):
    pass
client.WeightsCorrupt = WeightsCorrupt
client.Gms = client.GmsError = client.KvCache = client.find_library = None
sys.modules["shadow_gms.client"] = client
import shadow_gms
shadow_gms.client = client
import engine
from heartbeat import Heartbeat
from shadow_gms import Watchdog

class Kv:
    nbytes = 0

def generate(tokens, max_tokens, step=None, emit=None):
    out = []
    for i in range(max_tokens):
        time.sleep(float(os.environ["TOKEN_S"]))
        t = (sum(tokens) * (i + 3)) % 95
        out.append(t)
        if emit is not None:
            emit(t)
        if step is not None:
            step()
    return out

socket_fd = int(sys.argv[2])
import socket
inherited = socket.socket(fileno=socket_fd)
engine.serve(os.environ["SHADOW_ENGINE_ID"], 0, inherited, Kv(), lambda: engine.Done({}), generate,
             Heartbeat(Watchdog()))
"""


class FetchServer:
    """The shim's fetch socket, for whoever connects: the runtime's whole
    store (names and descriptors), then END=<n>; the store is kept."""

    def __init__(self, path, runtime):
        self.runtime = runtime
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.sock.bind(path)
        self.sock.listen(4)
        self.fetches = 0
        # Fetches refused before one is answered (the runtime has not seen
        # the lock taken yet), and a gate each answer waits at (a runtime
        # busy right after a failover).
        self.refuse = 0
        self.refused = 0
        self.gate = threading.Event()
        self.gate.set()
        threading.Thread(target=self.run, daemon=True).start()

    def run(self):
        while True:
            try:
                c, _ = self.sock.accept()
            except OSError:
                return
            with c:
                if self.refused < self.refuse:
                    self.refused += 1
                    c.send(b"ERROR=slot 1 does not hold the election lock (nobody does): take the lock first")
                    continue
                self.gate.wait()
                # What the dead engine sent before it died is read first
                # (all of it waits in the queue: it is dead).
                self.runtime.drain(0)
                with self.runtime.lock:
                    items = [(n, fd) for n, fds in self.runtime.store.items() for fd in fds]
                for i in range(0, len(items), 8):
                    part = items[i:i + 8]
                    names = ":".join(n for n, _ in part)
                    c.sendmsg([f"FDNAMES={names}".encode()],
                              [(socket.SOL_SOCKET, socket.SCM_RIGHTS, bytes(
                                  b for _, fd in part for b in fd.to_bytes(4, sys.byteorder)))])
                c.send(f"END={len(items)}".encode())
                self.fetches += 1

    def close(self):
        self.sock.close()


class EngineServeTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="torch-serve-")
        self.addCleanup(shutil.rmtree, self.dir)
        self.runtime = Runtime(os.path.join(self.dir, "notify.sock"))
        self.addCleanup(self.runtime.close)
        self.fetch = FetchServer(os.path.join(self.dir, "fdstore.sock"), self.runtime)
        self.addCleanup(self.fetch.close)
        self.lst = socket.socket()
        self.addCleanup(self.lst.close)
        self.lst.bind(("127.0.0.1", 0))
        self.lst.listen(64)
        self.port = self.lst.getsockname()[1]
        self.engines = []

    def tearDown(self):
        for e in self.engines:
            if e.poll() is None:
                e.kill()
            e.wait()
            e.stdout.close()

    def engine(self, engine_id):
        env = dict(os.environ, NOTIFY_SOCKET=self.runtime.path, SHADOW_ENGINE_ID=str(engine_id),
                   SHADOW_LOCK_PATH=os.path.join(self.dir, "engine.lock"),
                   SHADOW_FDSTORE_SOCKET=os.path.join(self.dir, "fdstore.sock"), TOKEN_S=str(TOKEN_S))
        env.pop("WATCHDOG_USEC", None)
        e = subprocess.Popen([sys.executable, "-c", ENGINE, HERE, str(self.lst.fileno())],
                             pass_fds=[self.lst.fileno()], env=env, stdout=subprocess.PIPE, text=True)
        self.engines.append(e)
        return e

    def event(self, proc, name):
        """The engine's next JSON line of event ``name`` (its log)."""
        for line in proc.stdout:
            ev = json.loads(line)
            if ev.get("event") == name:
                return ev
        self.fail(f"engine ended before {name}")

    def test_the_promoted_engine_finishes_the_stream_the_dead_one_began(self):
        a = self.engine(0)
        self.event(a, "active")
        b = self.engine(1)  # parked on the lock A holds
        req = {"prompt": "resume", "max_tokens": 30, "stream": True}
        s = post(self.port, req)
        first = read_all(s, until=b"data: ")
        while first.count(b"\n\ndata: ") < 8:
            first += s.recv(65536)
        os.kill(a.pid, signal.SIGKILL)
        a.wait()
        active = self.event(b, "active")
        self.assertTrue(active["fdstore"], active)
        resumed = self.event(b, "resumed")
        self.assertEqual((resumed["connections"], resumed["continued"]), (1, 1), resumed)
        got = events(first + read_all(s))
        s.close()
        self.assertEqual(got[-1], b"[DONE]")
        bodies = [json.loads(e) for e in got[:-1]]
        self.assertEqual(len(bodies), 31)
        self.assertEqual(len({x["id"] for x in bodies}), 1)
        text = "".join(x["choices"][0]["text"] for x in bodies)
        # An undisturbed answer, plain, from B: the same text.
        p = post(self.port, {"prompt": "resume", "max_tokens": 30})
        raw = read_all(p)
        p.close()
        head, _, body = raw.partition(b"\r\n\r\n")
        self.assertIn(b"Connection: close", head)
        plain = json.loads(body)
        self.assertEqual(plain["choices"][0]["text"], text)
        self.assertEqual(plain["object"], "text_completion")
        # Every stored connection was removed once answered.
        deadline = time.monotonic() + 10
        while self.runtime.store:
            self.assertLess(time.monotonic(), deadline, f"left in the store: {list(self.runtime.store)}")
            self.runtime.drain(0.05)
        # One fetch per engine that took the lock: the first found it empty.
        self.assertEqual(self.fetch.fetches, 2)

    def test_new_connections_are_served_while_the_fetch_waits_on_the_runtime(self):
        """The promoted engine fetches the store on a thread: a request
        that comes while the runtime has not answered the fetch (refused
        once, then held) is answered meanwhile; the stream the dead engine
        began is finished once the fetch is in."""
        a = self.engine(0)
        self.event(a, "active")
        b = self.engine(1)
        s = post(self.port, {"prompt": "held", "max_tokens": 30, "stream": True})
        first = read_all(s, until=b"data: ")
        while first.count(b"\n\ndata: ") < 4:
            first += s.recv(65536)
        self.fetch.refuse = 1
        self.fetch.gate.clear()
        os.kill(a.pid, signal.SIGKILL)
        a.wait()
        self.event(b, "active")
        p = post(self.port, {"prompt": "new", "max_tokens": 2})
        raw = read_all(p)
        p.close()
        self.assertTrue(raw.startswith(b"HTTP/1.1 200"), raw[:80])
        self.assertEqual(self.fetch.fetches, 1, "the fetch was answered before the new request")
        first_answer = self.event(b, "first-answer")
        self.assertEqual(first_answer["first_conn"], "new", first_answer)
        self.assertIsNone(first_answer["fetched_ms"], first_answer)
        self.fetch.gate.set()
        fetched = self.event(b, "fdstore-fetched")
        self.assertEqual(fetched["attempt"], 2, fetched)
        resumed = self.event(b, "resumed")
        self.assertEqual((resumed["connections"], resumed["continued"]), (1, 1), resumed)
        got = events(first + read_all(s))
        s.close()
        self.assertEqual(got[-1], b"[DONE]")
        self.assertEqual(len(got), 32)


if __name__ == "__main__":
    unittest.main()
