"""Tests of continuity.py without torch: a fake model behind the real
resume logic. The test plays the runtime: it keeps what an engine stores
(FDSTORE=1 datagrams on a NOTIFY_SOCKET of its own, the engine using
shadow_gms's helpers unchanged), SIGKILLs the engine in the middle of its
answers, and hands the store to a second engine, which must finish every
answer as if nothing happened."""

import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "..", "..", "gms", "python"))

import continuity  # noqa: E402
from shadow_gms import bytes_written, fdstore_remove, fdstore_store  # noqa: E402

# Seconds per token of the fake model: a stream of 20 lasts 0.6 s.
TOKEN_S = 0.03


def fake_answer(method, path, body, head):
    """A deterministic fake model: the tokens follow from the prompt."""
    if method == "GET" and path == "/health":
        return continuity.Plain(200, {"pid": os.getpid()})
    if method != "POST" or path != "/v1/completions":
        return continuity.Plain(404, {"error": "not found"})
    req = json.loads(body or b"{}")
    prompt, n = str(req.get("prompt", "")), int(req.get("max_tokens", 4))
    texts = [f" {prompt[:3]}{(sum(map(ord, prompt)) * (i + 7)) % 1000}" for i in range(n)]

    def run(emit):
        for t in texts:
            time.sleep(TOKEN_S)  # the model's time per token
            emit(t)

    if req.get("stream"):
        return continuity.Stream(len(prompt), run)
    run(lambda _: None)
    return continuity.Plain(200, {"text": "".join(texts), "pid": os.getpid()})


def engine_main(listen_fd):
    """The engine the test kills: accepts and answers one connection at a
    time on the inherited listener, storing each."""
    lst = socket.socket(fileno=listen_fd)
    cont = continuity.Continuity(fake_answer, fdstore_store, fdstore_remove, bytes_written)
    print("serving", flush=True)
    while True:
        sock, _ = lst.accept()
        cont.serve(cont.accepted(sock), timeout=10)


class Runtime:
    """The runtime's side of the store: a notify socket whose FDSTORE=1
    datagrams it keeps (by name, in order) and whose FDSTOREREMOVE=1 drop."""

    def __init__(self, path):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.path = path
        self.store = {}
        self.stored = 0
        self.lock = threading.Lock()

    def drain(self, wait):
        """Reads every datagram that waits (for up to ``wait`` seconds for
        the first; 0: only what is there)."""
        self.sock.settimeout(wait if wait > 0 else 0.0)
        while True:
            try:
                msg, anc, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(16 * 4))
            except (socket.timeout, BlockingIOError):
                return
            self.sock.settimeout(0)
            fds = []
            for level, kind, data in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                    fds.extend(int.from_bytes(data[i:i + 4], sys.byteorder) for i in range(0, len(data) - 3, 4))
            lines = msg.decode().splitlines()
            name = next((l[7:] for l in lines if l.startswith("FDNAME=")), "stored")
            with self.lock:
                if "FDSTORE=1" in lines:
                    self.store.setdefault(name, []).extend(fds)
                    self.stored += 1
                elif "FDSTOREREMOVE=1" in lines:
                    for fd in self.store.pop(name, []):
                        os.close(fd)
                for fd in fds if "FDSTORE=1" not in lines else []:
                    os.close(fd)

    def take(self):
        """The whole store as a fetch returns it, [(name, fd)], emptied."""
        with self.lock:
            out = [(n, fd) for n, fds in self.store.items() for fd in fds]
            self.store = {}
        return out

    def close(self):
        for _, fd in self.take():
            os.close(fd)
        self.sock.close()


def post(port, body):
    c = socket.create_connection(("127.0.0.1", port), timeout=10)
    data = json.dumps(body).encode()
    c.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
              + f"Content-Length: {len(data)}\r\n\r\n".encode() + data)
    return c


def read_all(c, until=None):
    """Reads to the end (or until ``until`` is in what was read)."""
    got = b""
    while until is None or until not in got:
        b = c.recv(65536)
        if not b:
            break
        got += b
    return got


def health_while_resumed(cont, conn, c):
    """Sends ``GET /health`` on the client side ``c`` of ``conn`` while
    ``cont`` resumes it (the request comes after the takeover): the raw
    answer, read to the end; ``c`` is closed."""
    resumed = threading.Thread(target=cont.resume, args=(conn, 10))
    resumed.start()
    c.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
    raw = read_all(c)
    c.close()
    resumed.join()
    return raw


def events(raw):
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK"), head
    assert b"text/event-stream" in head, head
    out = [e for e in body.split(b"\n\n") if e]
    assert all(e.startswith(b"data: ") for e in out), out
    return [e[6:] for e in out]


class ContinuityTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.mkdtemp(prefix="torch-continuity-")
        self.runtime = Runtime(os.path.join(self.dir, "notify.sock"))
        self.lst = socket.socket()
        self.lst.bind(("127.0.0.1", 0))
        self.lst.listen(64)
        self.port = self.lst.getsockname()[1]
        env = dict(os.environ, NOTIFY_SOCKET=self.runtime.path)
        self.engine = subprocess.Popen(
            [sys.executable, __file__, "engine", str(self.lst.fileno())],
            pass_fds=[self.lst.fileno()], env=env, stdout=subprocess.PIPE, text=True)
        self.assertEqual(self.engine.stdout.readline().strip(), "serving")

    def tearDown(self):
        if self.engine.poll() is None:
            self.engine.kill()
        self.engine.wait()
        self.engine.stdout.close()
        self.runtime.close()
        self.lst.close()
        shutil.rmtree(self.dir)

    def stored(self, n):
        """Waits until the engine has stored ``n`` connections in all."""
        deadline = time.monotonic() + 10
        while self.runtime.stored < n:
            self.assertLess(time.monotonic(), deadline, f"{self.runtime.stored} of {n} stored")
            self.runtime.drain(0.05)

    def kill_and_take_over(self):
        """SIGKILLs the engine; a second engine (this process) takes the
        store over, as a promoted engine does: it and the one connection
        the store held."""
        os.kill(self.engine.pid, signal.SIGKILL)
        self.engine.wait()
        # Dead: all it sent waits in the socket's queue.
        self.runtime.drain(0)
        cont = continuity.Continuity(fake_answer, fdstore_store, fdstore_remove, bytes_written)
        conns = cont.take_over(self.runtime.take())
        self.assertEqual(len(conns), 1, [c.name for c in conns])
        return cont, conns

    def phase_is(self, phase):
        """Waits until the one stored connection's state says ``phase``."""
        deadline = time.monotonic() + 10
        while True:
            with self.runtime.lock:
                fds = [fd for fds in self.runtime.store.values() for fd in fds]
            states = [continuity.read_state(fd)[0] for fd in fds if not continuity._is_socket(fd)]
            if states == [phase]:
                return
            self.assertLess(time.monotonic(), deadline, f"states {states}")
            self.runtime.drain(0.01)

    def undisturbed(self, body):
        """The answer of an engine nobody kills (this process's)."""
        c = post(self.port, body)
        cont = continuity.Continuity(fake_answer, lambda *a: False, lambda *a: False, bytes_written, enabled=False)
        self.engine.kill()
        self.engine.wait()
        sock, _ = self.lst.accept()
        cont.serve(cont.accepted(sock), timeout=10)
        with c:
            return read_all(c)

    def test_answers_in_flight_outlive_a_sigkill(self):
        stream_req = {"prompt": "stream me", "max_tokens": 20, "stream": True}
        # A stream cut after 5 of its 20 tokens.
        s = post(self.port, stream_req)
        self.stored(1)
        first = read_all(s, until=b"data: ")
        while first.count(b"\n\ndata: ") < 5:
            first += s.recv(65536)
        cont, conns = self.kill_and_take_over()
        for c in conns:
            cont.resume(c, timeout=10)
        self.assertEqual(cont.stats["continued"], 1, cont.stats)
        rest = read_all(s)
        s.close()
        got = events(first + rest)
        self.assertEqual(got[-1], b"[DONE]")
        bodies = [json.loads(e) for e in got[:-1]]
        self.assertEqual(len(bodies), 21)
        self.assertEqual(len({b["id"] for b in bodies}), 1, "one stream, one id")
        self.assertEqual(bodies[-1]["choices"][0]["finish_reason"], "length")
        self.assertEqual(bodies[-1]["usage"]["completion_tokens"], 20)
        text = "".join(b["choices"][0]["text"] for b in bodies)
        # The same text as a stream nobody cut.
        want = events(self.undisturbed(stream_req))
        self.assertEqual(text, "".join(json.loads(e)["choices"][0]["text"] for e in want[:-1]))

    def test_a_request_recorded_or_not_yet_sent_is_answered_by_the_next_engine(self):
        # A plain answer whose generation (0.3 s) the kill interrupts.
        p = post(self.port, {"prompt": "plain", "max_tokens": 10})
        self.stored(1)
        self.phase_is(continuity.RECORDED)
        cont, conns = self.kill_and_take_over()
        phase = continuity.read_state(conns[0].state.fd)[0]
        self.assertEqual(phase, continuity.RECORDED)
        cont.resume(conns[0], timeout=10)
        self.assertEqual(cont.stats["answered_again"], 1, cont.stats)
        raw = read_all(p)
        p.close()
        head, _, body = raw.partition(b"\r\n\r\n")
        self.assertTrue(head.startswith(b"HTTP/1.1 200 OK"), raw)
        self.assertEqual(json.loads(body)["text"],
                         "".join(f" pla{(sum(map(ord, 'plain')) * (i + 7)) % 1000}" for i in range(10)))

    def test_a_connection_whose_request_had_not_come_is_read_by_the_next_engine(self):
        c = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        self.stored(1)
        cont, conns = self.kill_and_take_over()
        # Sent after the engine that accepted it died: the next one reads it.
        raw = health_while_resumed(cont, conns[0], c)
        head, _, body = raw.partition(b"\r\n\r\n")
        self.assertTrue(head.startswith(b"HTTP/1.1 200 OK"), raw)
        self.assertEqual(json.loads(body)["pid"], os.getpid())

    def test_connections_the_runtime_accepted_are_served_and_adopted(self):
        """shadow.dev/accept: runtime: a connection handed over is in the
        store already, so only its state is stored beside it, and its name
        removed once answered; one the runtime holds with no state (its
        engine died before it stored one) gets a state of its own when a
        promoted engine takes it over."""
        self.engine.kill()
        self.engine.wait()
        calls = []

        def store(fds, name, poll=True):
            calls.append(("store", name, [continuity._is_socket(fd) for fd in fds], poll))
            return True

        def remove(name):
            calls.append(("remove", name))
            return True

        cont = continuity.Continuity(fake_answer, store, remove, bytes_written)
        p = post(self.port, {"prompt": "handed", "max_tokens": 3})
        sock, _ = self.lst.accept()
        conn = cont.handed(sock, "accepted.0.1")
        self.assertEqual(calls, [("store", "accepted.0.1", [False], False)])
        cont.serve(conn, timeout=10)
        self.assertEqual(calls[-1], ("remove", "accepted.0.1"))
        raw = read_all(p)
        p.close()
        self.assertTrue(raw.startswith(b"HTTP/1.1 200 OK"), raw)

        calls.clear()
        c = socket.create_connection(("127.0.0.1", self.port), timeout=10)
        held, _ = self.lst.accept()
        conns = cont.take_over([("accepted.0.2", os.dup(held.fileno()))])
        held.close()
        self.assertEqual([x.name for x in conns], ["accepted.0.2"])
        self.assertIsNotNone(conns[0].state)
        self.assertEqual(calls, [("store", "accepted.0.2", [False], False)])
        raw = health_while_resumed(cont, conns[0], c)
        self.assertTrue(raw.startswith(b"HTTP/1.1 200 OK"), raw)
        self.assertEqual(calls[-1], ("remove", "accepted.0.2"))

    def test_state_round_trips_and_a_foreign_memfd_is_read_as_new(self):
        st = continuity.State.create("t")
        self.assertEqual(continuity.read_state(st.fd)[0], continuity.NEW)
        st.record(b"GET / HTTP/1.1\r\n\r\n", {"id": "cmpl-1", "created": 5})
        phase, rec, ans, n = continuity.read_state(st.fd)
        self.assertEqual((phase, rec["request"], rec["id"], ans), (continuity.RECORDED, b"GET / HTTP/1.1\r\n\r\n", "cmpl-1", None))
        st.answer(b"HTTP/1.1 200 OK\r\n\r\n{}")
        self.assertEqual(continuity.read_state(st.fd)[2], b"HTTP/1.1 200 OK\r\n\r\n{}")
        st.close()
        other = os.memfd_create("other")
        os.write(other, b"x" * 100)
        self.assertEqual(continuity.read_state(other)[0], continuity.NEW)
        os.close(other)

    def test_a_streams_kv_section_holds_what_was_committed_only(self):
        st = continuity.State.create("kv")
        self.assertIsNone(continuity.read_kv(st.fd), "no section before the engine begins one")
        progress = continuity.KvProgress(st.fd, name="c-1")
        progress.begin(pool=42, prompt_tokens=33)
        for i, blk in enumerate([7, 9, 4]):
            progress.block(i, blk)
        progress.commit(1, 500)
        progress.commit(2, 501)
        # A token written but not committed (the engine died between the
        # id and the word): not read.
        os.pwrite(st.fd, struct.pack("<I", 999), continuity.KV_AT + continuity._KV_TOKENS_AT + 8)
        kv = continuity.read_kv(st.fd)
        self.assertEqual((kv["pool"], kv["prompt"], kv["committed"], kv["tokens"]), (42, 33, 2, [500, 501]))
        self.assertEqual(kv["blocks"][:3], [7, 9, 4])
        clone = progress.clone()
        self.assertNotEqual(clone.fd, progress.fd)
        self.assertEqual(clone.name, "c-1")
        progress.close()
        clone.commit(3, 502)
        self.assertEqual(continuity.read_kv(st.fd)["tokens"], [500, 501, 502], "a clone outlives the original")
        clone.close()
        past = continuity.KvProgress(st.fd)
        with self.assertRaises(ValueError):
            past.commit(continuity.KV_TOKENS_MAX + 1, 0)
        past.close()
        st.close()

    def test_request_lengths(self):
        self.assertIsNone(continuity.request_length(b"POST / HTTP/1.1\r\nContent-Length: 5\r\n\r\nab"))
        self.assertEqual(continuity.request_length(b"POST / HTTP/1.1\r\nContent-Length: 2\r\n\r\nabXX"), 40)
        with self.assertRaises(continuity.BadRequest):
            continuity.request_length(b"POST / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n")
        with self.assertRaises(continuity.BadRequest):
            continuity.request_length(b"POST / HTTP/1.1\r\nContent-Length: 99999999\r\n\r\n")


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "engine":
        engine_main(int(sys.argv[2]))
    else:
        unittest.main()
