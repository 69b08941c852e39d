"""Tests of shadow_gms.contract's fd-store helpers, standard library only:
what they send on NOTIFY_SOCKET (the datagram and its descriptors, as
sd_notify(3) has them) and how a fetch reads the store's packets, against a
stand-in for the shim's sockets. `cargo test -p gms` runs them.
"""

import array
import os
import socket
import sys
import tempfile
import threading
import unittest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from shadow_gms.contract import (FdStoreError, accepted_by_runtime, bytes_written, fdstore_fetch,  # noqa: E402
                                 fdstore_remove, fdstore_store, handoff_receive, is_accepted_name)

LIMIT_S = 20


def recv_with_fds(sock):
    msg, anc, _, _ = sock.recvmsg(4096, socket.CMSG_SPACE(16 * 4))
    fds = array.array("i")
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    return msg, list(fds)


class StoreTest(unittest.TestCase):
    def setUp(self):
        self.dir = tempfile.TemporaryDirectory()
        self.addCleanup(self.dir.cleanup)
        self.path = os.path.join(self.dir.name, "notify.sock")
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.addCleanup(self.sock.close)
        self.sock.bind(self.path)
        self.sock.settimeout(LIMIT_S)

    def test_store_sends_fdstore_with_the_descriptors(self):
        r, w = os.pipe()
        self.addCleanup(os.close, r)
        self.addCleanup(os.close, w)
        self.assertTrue(fdstore_store([w], "conn-1", path=self.path))
        msg, fds = recv_with_fds(self.sock)
        self.assertEqual(msg, b"FDSTORE=1\nFDNAME=conn-1\n")
        self.assertEqual(len(fds), 1)
        # The same pipe: what is written on the received copy reads at r.
        os.write(fds[0], b"x")
        os.close(fds[0])
        self.assertEqual(os.read(r, 1), b"x")
        self.assertTrue(fdstore_store([w], "keep", poll=False, path=self.path))
        msg, fds = recv_with_fds(self.sock)
        self.assertEqual(msg, b"FDSTORE=1\nFDNAME=keep\nFDPOLL=0\n")
        for fd in fds:
            os.close(fd)

    def test_remove_and_bad_names(self):
        self.assertTrue(fdstore_remove("conn-1", path=self.path))
        msg, fds = recv_with_fds(self.sock)
        self.assertEqual((msg, fds), (b"FDSTOREREMOVE=1\nFDNAME=conn-1\n", []))
        for bad in ["", "a:b", "x" * 256, "tab\there"]:
            with self.assertRaises(ValueError):
                fdstore_store([0], bad, path=self.path)

    def test_without_a_socket_nothing_is_sent(self):
        env = os.environ.pop("NOTIFY_SOCKET", None)
        try:
            self.assertFalse(fdstore_store([0], "x"))
            self.assertIsNone(fdstore_fetch(path=""))
        finally:
            if env is not None:
                os.environ["NOTIFY_SOCKET"] = env


class BytesWrittenTest(unittest.TestCase):
    def test_what_was_written_is_what_the_socket_says(self):
        with socket.socket() as lst:
            lst.bind(("127.0.0.1", 0))
            lst.listen()
            c = socket.create_connection(lst.getsockname())
            s, _ = lst.accept()
            with c, s:
                self.assertEqual(bytes_written(s), 0)
                s.sendall(b"x" * 1000)
                c.recv(100)
                self.assertEqual(bytes_written(s), 1000)
                s.setblocking(False)
                total = 1000
                try:
                    while True:
                        total += s.send(b"y" * 65536)
                except BlockingIOError:
                    pass
                self.assertEqual(bytes_written(s.fileno()), total)
                # Our FIN is no byte written.
                s.shutdown(socket.SHUT_WR)
                self.assertEqual(bytes_written(s), total)


class FetchTest(unittest.TestCase):
    """A stand-in for the shim's fetch socket answers each connection with
    the packets the test gives it."""

    def serve(self, answers):
        d = tempfile.TemporaryDirectory()
        self.addCleanup(d.cleanup)
        path = os.path.join(d.name, "fdstore.sock")
        srv = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.addCleanup(srv.close)
        srv.bind(path)
        srv.listen(4)
        srv.settimeout(LIMIT_S)

        def run():
            for packets in answers:
                c, _ = srv.accept()
                with c:
                    for text, n in packets:
                        fds = [os.open("/dev/null", os.O_RDONLY) for _ in range(n)]
                        anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())] if fds else []
                        c.sendmsg([text], anc)
                        for fd in fds:
                            os.close(fd)

        t = threading.Thread(target=run, daemon=True)
        t.start()
        self.addCleanup(t.join, LIMIT_S)
        return path

    def test_a_fetch_reads_names_and_descriptors_until_end(self):
        path = self.serve([
            [(b"FDNAMES=a:b\n", 2), (b"FDNAMES=c\n", 1), (b"END=3\n", 0)],
            [(b"ERROR=not the lock holder\n", 0)],
            [(b"FDNAMES=a\n", 1), (b"END=2\n", 0)],
        ])
        got = fdstore_fetch(path=path)
        self.assertEqual([n for n, _ in got], ["a", "b", "c"])
        for _, fd in got:
            self.assertFalse(os.get_inheritable(fd))
            os.close(fd)
        with self.assertRaisesRegex(FdStoreError, "not the lock holder"):
            fdstore_fetch(path=path)
        with self.assertRaises(FdStoreError):
            fdstore_fetch(path=path)


# Run in a child: LISTEN_PID must be its pid, and descriptors 3.. its own.
INHERIT = r"""
import os, socket, sys
sys.path.insert(0, sys.argv[1])
lst = socket.socket(); lst.bind(("127.0.0.1", 0)); lst.listen(4)
client = socket.create_connection(lst.getsockname())
conn, _ = lst.accept()
mem = os.memfd_create("state")
for want, fd in ((3, lst.fileno()), (4, conn.fileno()), (5, mem)):
    os.dup2(fd, want + 10)
for want in (3, 4, 5):
    os.dup2(want + 10, want)
    os.close(want + 10)
os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS="3", LISTEN_FDNAMES="tcp-8000:c-1:c-1")
from shadow_gms.contract import fdstore_inherited, listen_sockets
print([n for n, _ in listen_sockets()], fdstore_inherited(), fdstore_inherited())
"""


class InheritedTest(unittest.TestCase):
    def test_the_stores_descriptors_are_no_listening_sockets(self):
        import subprocess

        root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
        out = subprocess.run([sys.executable, "-c", INHERIT, root], capture_output=True, text=True,
                             timeout=LIMIT_S)
        self.assertEqual(out.returncode, 0, out.stderr)
        self.assertEqual(out.stdout.strip(), "['tcp-8000'] [('c-1', 4), ('c-1', 5)] []")



class HandoffTest(unittest.TestCase):
    """The engine's side of shadow.dev/accept: runtime, against a stand-in
    for the shim's end of a hand-off socket."""

    def setUp(self):
        self.ours, self.theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self.addCleanup(self.ours.close)
        self.addCleanup(self.theirs.close)
        self.theirs.settimeout(LIMIT_S)

    def witness(self):
        """A socket pair: one end to send; reading the other tells whether
        every copy of the sent end was closed."""
        a, b = socket.socketpair()
        b.settimeout(LIMIT_S)
        self.addCleanup(b.close)
        return a, b

    def test_a_packet_gives_the_name_and_the_connection(self):
        self.assertTrue(accepted_by_runtime({"SHADOW_ACCEPT": "runtime"}))
        self.assertFalse(accepted_by_runtime({"SHADOW_ACCEPT": "engine"}))
        self.assertFalse(accepted_by_runtime({}))
        self.assertTrue(is_accepted_name("accepted.0.7"))
        a, b = self.witness()
        self.ours.sendmsg([b"FDNAME=accepted.0.7\n"], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [a.fileno()]))])
        a.close()
        name, conn = handoff_receive(self.theirs)
        self.assertEqual(name, "accepted.0.7")
        self.assertFalse(conn.get_inheritable())
        conn.sendall(b"hi")
        self.assertEqual(b.recv(2), b"hi")
        conn.close()
        self.ours.close()
        self.assertIsNone(handoff_receive(self.theirs))

    def test_malformed_packets_are_refused_and_their_descriptors_closed(self):
        for text, n in ((b"FDNAME=x\n", 0), (b"FDNAME=x\n", 2), (b"FDNAME=a:b\n", 1), (b"NAME=x\n", 1),
                        (b"x" * 400, 1)):
            pairs = [self.witness() for _ in range(n)]
            anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [a.fileno() for a, _ in pairs]))] if n else []
            self.ours.sendmsg([text], anc)
            for a, _ in pairs:
                a.close()
            with self.assertRaises(ValueError):
                handoff_receive(self.theirs)
            for _, b in pairs:
                self.assertEqual(b.recv(1), b"", f"{text!r}: a descriptor was left open")



if __name__ == "__main__":
    unittest.main()
