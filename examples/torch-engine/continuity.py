"""Continuity for the torch engine: an accepted connection, and the request
on it, outlive the engine answering it (the pair's fd store; the pattern is
docs/engine-contract.md's "The pair's fd store").

Why a module of its own: none of it needs torch or a GPU, so the whole
resume logic runs in ``make test`` (test_continuity.py) with a fake model,
and the engine only plugs its ``generate`` into it.

Every connection is stored the moment it is accepted, together with a
memfd of its resume state, both under one name (``c-<boot>-<n>``); it is
removed once its answer is written. When the runtime accepts
(``shadow.dev/accept: runtime``) the connection is in the store before this
engine has it, under the runtime's name (``accepted.<listener>.<n>``), and
only the state memfd is stored beside it. The state is this engine's own
format:

    offset size
     0      8   magic b"SHDWTRCH"
     8      4   version (1), little-endian like every field
    12      4   zero
    16      8   record length
    24      8   answer length
    32      8   phase: 0 new, 1 recorded, 2 answering, 3 done
    40     24   zero
    64      …   record: JSON {"request": base64 of the request's bytes,
                "id", "created"} (a stream's head, chosen once)
     …      …   answer: a plain answer's whole response bytes

A stream whose engine carries its KV cache (``Stream(kv=True)``) has one
more section, at ``KV_AT`` (16 MiB: past any record or answer; the memfd
is sparse), written by the engine's decode loop:

    offset size
     0      8   magic b"SHDWTKSQ"
     8      8   the KV pool's id (a pool made anew has another)
    16      4   prompt tokens, as the engine cut the prompt
    20      4   zero
    24      8   tokens generated and committed: the commit word
    32   1024   block ids, u32 each (the sequence's block table)
  1056   1024   generated token ids, u32 each

A token's id is written before the commit word that counts it, and the
word only once the KV of every position before that token is written and
synchronised in the pool, in the blocks the table names (the table entry
is written when the block is taken, before anything is launched into
it). A promoted engine reads the section once the store is fetched
(``read_kv``) and goes on from the committed tokens (engine.py).

The phase word is the commit point: the record, then the answer, are
written before the phase that names them, and the phase is one 8-byte
``pwrite`` at a fixed offset of one page (SIGKILL does not split it).
``new``: the request, if any, is still in the socket (it is read with
``MSG_PEEK`` and recorded before a byte of it is consumed). ``recorded``:
nothing of the answer is written yet. ``answering``: some of it may be;
how much, the socket says (``bytes_written``: what the peer acknowledged
plus what is queued), and the promoted engine writes the rest. A plain
answer's bytes are in the state; a stream's are a pure function of its
head and its tokens, which the engine either takes from the KV section
below (the tokens committed, and the KV they need in the pair's KV pool)
or computes again from the prompt, so every byte after the ones the
client has is the byte the dead engine would have written.

Each resumable connection carries one request (``Connection: close``): the
answer ends with the connection, which the engine shuts down for writing
before it closes (its copy in the store must not keep the client waiting).
"""

import base64
import json
import os
import select
import socket
import stat
import struct
import time
import uuid

from shadow_gms import is_accepted_name

MAGIC = b"SHDWTRCH"
VERSION = 1
HEADER = 64
PHASE_AT = 32
NEW, RECORDED, ANSWERING, DONE = 0, 1, 2, 3
# A request larger than this is refused (413): it could not be recorded.
REQUEST_MAX = 1 << 20
# The most read back from a state memfd; more is no state of ours.
STATE_MAX = 8 << 20
MODEL = "shadow-torch"
KV_AT = 16 << 20
KV_MAGIC = b"SHDWTKSQ"
KV_BLOCKS_MAX = 256
KV_TOKENS_MAX = 256
_KV_BLOCKS_AT = 32
_KV_TOKENS_AT = _KV_BLOCKS_AT + 4 * KV_BLOCKS_MAX


class State:
    """One connection's resume state, in a memfd this object owns."""

    def __init__(self, fd):
        self.fd = fd
        self.record_len = 0

    @classmethod
    def create(cls, name):
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        try:
            os.pwrite(fd, MAGIC + struct.pack("<II", VERSION, 0) + bytes(HEADER - 16), 0)
        except OSError:
            os.close(fd)
            raise
        return cls(fd)

    def _phase(self, phase):
        os.pwrite(self.fd, struct.pack("<Q", phase), PHASE_AT)

    def record(self, request, head):
        data = json.dumps({"request": base64.b64encode(request).decode(), **head}).encode()
        os.pwrite(self.fd, data, HEADER)
        os.pwrite(self.fd, struct.pack("<Q", len(data)), 16)
        self.record_len = len(data)
        self._phase(RECORDED)

    def answer(self, data):
        """A plain answer's bytes, before the first of them is written."""
        os.pwrite(self.fd, data, HEADER + self.record_len)
        os.pwrite(self.fd, struct.pack("<Q", len(data)), 24)
        self._phase(ANSWERING)

    def answering(self):
        """A stream: its bytes follow from the record."""
        self._phase(ANSWERING)

    def done(self):
        self._phase(DONE)

    def close(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


class KvProgress:
    """A stream's KV section in its state memfd (``KV_AT``), written by the
    engine's decode loop. It owns a descriptor of its own (a duplicate), so
    that the loop may write it after the connection's thread has closed the
    state: it is closed by ``close()``."""

    def __init__(self, fd, carried=None, name=None):
        self.fd = os.dup(fd)
        # What the engine before this one committed (read_kv), for a
        # resumed stream; None for a new one.
        self.carried = carried
        # The connection's name in the store.
        self.name = name

    def clone(self):
        """Another KvProgress over the same section, with a descriptor of
        its own (the decode loop's, closed when its sequence ends)."""
        return KvProgress(self.fd, self.carried, self.name)

    def begin(self, pool, prompt_tokens):
        """A new sequence in pool ``pool``: nothing committed yet."""
        os.pwrite(self.fd, KV_MAGIC + struct.pack("<QIIQ", pool, prompt_tokens, 0, 0), KV_AT)

    def block(self, ordinal, block):
        """Block ``block`` is the sequence's ``ordinal``-th: written before
        anything is launched into it."""
        if ordinal >= KV_BLOCKS_MAX:
            raise ValueError(f"block {ordinal} past the section's {KV_BLOCKS_MAX}")
        os.pwrite(self.fd, struct.pack("<I", block), KV_AT + _KV_BLOCKS_AT + 4 * ordinal)

    def commit(self, n, token):
        """The ``n``-th generated token (1-based) is ``token``, and the KV of
        every position before it is in the pool: its id, then the word."""
        if n > KV_TOKENS_MAX:
            raise ValueError(f"token {n} past the section's {KV_TOKENS_MAX}")
        os.pwrite(self.fd, struct.pack("<I", token), KV_AT + _KV_TOKENS_AT + 4 * (n - 1))
        os.pwrite(self.fd, struct.pack("<Q", n), KV_AT + 24)

    def close(self):
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def read_kv(fd):
    """A state memfd's KV section: {"pool", "prompt", "committed",
    "blocks", "tokens"} (the tokens committed, and every block the table
    names), or None when there is none (or it is not whole)."""
    try:
        head = os.pread(fd, 32, KV_AT)
        if len(head) < 32 or head[:8] != KV_MAGIC:
            return None
        pool, prompt, _, committed = struct.unpack_from("<QIIQ", head, 8)
        if committed > KV_TOKENS_MAX or prompt == 0:
            return None
        blocks_used = min(KV_BLOCKS_MAX, -(-(prompt + KV_TOKENS_MAX) // 16))
        raw = os.pread(fd, 4 * blocks_used, KV_AT + _KV_BLOCKS_AT)
        toks = os.pread(fd, 4 * committed, KV_AT + _KV_TOKENS_AT)
        if len(raw) != 4 * blocks_used or len(toks) != 4 * committed:
            return None
        return {"pool": pool, "prompt": prompt, "committed": committed,
                "blocks": list(struct.unpack(f"<{blocks_used}I", raw)),
                "tokens": list(struct.unpack(f"<{committed}I", toks))}
    except OSError:
        return None


def read_state(fd):
    """(phase, record, answer, record length) of a state memfd; NEW and
    Nones for one that is not ours or not whole (then the socket is read
    afresh)."""
    try:
        head = os.pread(fd, HEADER, 0)
        if len(head) < HEADER or head[:8] != MAGIC:
            return NEW, None, None, 0
        version, = struct.unpack_from("<I", head, 8)
        record_len, answer_len, phase = struct.unpack_from("<QQQ", head, 16)
        if version != VERSION or phase not in (NEW, RECORDED, ANSWERING, DONE):
            return NEW, None, None, 0
        if phase == NEW or record_len + answer_len > STATE_MAX:
            return NEW, None, None, 0
        raw = os.pread(fd, record_len, HEADER)
        record = json.loads(raw)
        record["request"] = base64.b64decode(record["request"])
        answer = os.pread(fd, answer_len, HEADER + record_len) if answer_len else None
        if answer is not None and len(answer) != answer_len:
            return NEW, None, None, 0
        return phase, record, answer, record_len
    except (OSError, ValueError, KeyError, TypeError):
        return NEW, None, None, 0


class BadRequest(Exception):
    def __init__(self, status, why):
        super().__init__(why)
        self.status = status


def request_length(data):
    """The length of the whole request at the start of ``data`` (its head
    and the body its Content-Length says), or None while it is not all in."""
    end = data.find(b"\r\n\r\n")
    if end < 0:
        if len(data) > REQUEST_MAX:
            raise BadRequest(431, "request head too large")
        return None
    length = 0
    for line in data[:end].split(b"\r\n")[1:]:
        key, _, value = line.partition(b":")
        if key.strip().lower() == b"content-length":
            try:
                length = int(value.strip())
            except ValueError:
                raise BadRequest(400, "bad Content-Length") from None
            if length < 0:
                raise BadRequest(400, "bad Content-Length")
        elif key.strip().lower() == b"transfer-encoding":
            raise BadRequest(411, "a body needs a Content-Length")
    total = end + 4 + length
    if total > REQUEST_MAX:
        raise BadRequest(413, "request too large")
    return total if len(data) >= total else None


def peek_request(sock, timeout):
    """The whole request waiting in ``sock``, read without consuming it;
    None if the peer closed first or it did not all come within
    ``timeout`` seconds (None: no limit). Between looks the socket's
    ``SO_RCVLOWAT`` is one more byte than it holds, so that the wait ends
    when more has come (or the peer closed), not at once."""
    deadline = None if timeout is None else time.monotonic() + timeout
    size, have = 65536, 0
    try:
        while True:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                return None
            if not select.select([sock], [], [], left)[0]:
                return None
            data = sock.recv(size, socket.MSG_PEEK)
            if not data:
                return None
            total = request_length(data)
            if total is not None:
                return data[:total]
            if len(data) >= size:
                size *= 2  # more waits than was looked at: look again
                continue
            if len(data) == have:
                return None  # readable and nothing more: the peer closed
            have = len(data)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, have + 1)
    finally:
        if have:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)


def parse(raw):
    """(method, path, body) of a whole request."""
    end = raw.find(b"\r\n\r\n")
    line = raw[:end].split(b"\r\n", 1)[0].decode("latin-1")
    parts = line.split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        raise BadRequest(400, f"bad request line {line[:80]!r}")
    return parts[0], parts[1], raw[end + 4:]


def new_head():
    return {"id": "cmpl-" + uuid.uuid4().hex, "created": int(time.time())}


REASONS = {200: "OK", 400: "Bad Request", 404: "Not Found", 411: "Length Required",
           413: "Content Too Large", 431: "Request Header Fields Too Large",
           503: "Service Unavailable"}


def plain_response(status, body):
    data = json.dumps(body).encode()
    return (f"HTTP/1.1 {status} {REASONS.get(status, 'Error')}\r\n"
            "Content-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n"
            "Connection: close\r\n\r\n").encode() + data


STREAM_HEAD = (b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n"
               b"Cache-Control: no-cache\r\nConnection: close\r\n\r\n")
DONE_EVENT = b"data: [DONE]\n\n"


def _event(head, text, finish, usage=None):
    body = {"id": head["id"], "object": "text_completion", "created": head["created"], "model": MODEL,
            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}
    if usage is not None:
        body["usage"] = usage
    return b"data: " + json.dumps(body, separators=(",", ":")).encode() + b"\n\n"


def token_event(head, text):
    return _event(head, text, None)


def final_event(head, prompt_tokens, completion_tokens):
    return _event(head, "", "length", {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                                       "total_tokens": prompt_tokens + completion_tokens})


class Plain:
    """A whole answer: ``status`` and a JSON ``body``; ``after`` runs once it
    is written (the test hang)."""

    def __init__(self, status, body, after=None):
        self.status, self.body, self.after = status, body, after


class Stream:
    """A streamed completion: ``run(emit)`` generates it, calling
    ``emit(text)`` with each token's text as the token is decoded (each is
    one event on the wire at once); the prompt's token count goes into the
    usage. With ``kv``, ``run(emit, progress)``: ``progress`` is the
    stream's ``KvProgress`` (None without a state), whose ``carried`` says
    what the engine before committed when the stream is resumed."""

    def __init__(self, prompt_tokens, run, kv=False):
        self.prompt_tokens, self.run, self.kv = prompt_tokens, run, kv


class Writer:
    """Writes an answer's bytes from offset ``skip`` on: what the client
    already has is passed over, the rest sent; ``before`` runs once, before
    the first byte is (the engine's weights check)."""

    def __init__(self, sock, skip=0, before=None):
        self.sock, self.skip, self.sent, self.before = sock, skip, 0, before

    def write(self, data):
        if self.skip >= len(data):
            self.skip -= len(data)
            return
        if self.before is not None:
            before, self.before = self.before, None
            before()
        data, self.skip = data[self.skip:], 0
        self.sock.sendall(data)
        self.sent += len(data)


class Conn:
    """An accepted connection, with its state and its name in the store."""

    def __init__(self, sock, name, state, stored):
        self.sock, self.name, self.state, self.stored = sock, name, state, stored


class Continuity:
    """What the engine does with each connection. ``answer(method, path,
    body, head)`` routes a request and returns a Plain or a Stream;
    ``store``, ``remove`` and ``written`` are shadow_gms's
    ``fdstore_store``, ``fdstore_remove`` and ``bytes_written`` (tests pass
    others). ``enabled`` False: connections are answered the same way and
    stored nowhere (no store, or ``--no-fdstore``)."""

    def __init__(self, answer, store, remove, written, enabled=True, log=None):
        self.answer, self.store, self.remove, self.written = answer, store, remove, written
        self.enabled = enabled
        self.log = log or (lambda **_: None)
        # Runs before the first byte of every answer is written.
        self.before_write = None
        self.boot = f"{os.getpid()}.{time.time_ns() // 1000}"
        self.served = 0
        self.stats = {"resumed": 0, "unread": 0, "answered_again": 0, "continued": 0, "done": 0}

    def accepted(self, sock):
        """A connection just accepted: stored (with its state) first."""
        self.served += 1
        name = f"c-{self.boot}-{self.served}"
        if not self.enabled:
            return Conn(sock, name, None, False)
        state = State.create(name)
        return Conn(sock, name, state, self._keep([sock, state.fd], name))

    def _keep(self, fds, name):
        """Stores ``fds`` under ``name``: whether the store took them.
        poll=False (FDPOLL=0): removed once answered, so the runtime need
        not watch a socket for a hang-up."""
        try:
            return bool(self.store(fds, name, poll=False))
        except OSError as e:
            self.log(event="fdstore-store-failed", error=str(e))
            return False

    def handed(self, sock, name):
        """A connection the runtime accepted and handed over, in the store
        already under ``name``: its state memfd is stored beside it, and
        the name removed once it is answered."""
        self.served += 1
        return Conn(sock, name, self._state_for(name), True)

    def _state_for(self, name):
        """A new state memfd stored under ``name``; None when the store
        does not take it (the answer goes on unresumable)."""
        state = State.create(name)
        if self._keep([state.fd], name):
            return state
        state.close()
        return None

    def serve(self, conn, timeout=None, before=None):
        """Reads, records and answers the one request of a new connection."""
        try:
            raw = peek_request(conn.sock, timeout)
            if raw is None:
                self.log(event="unanswered", name=conn.name,
                         why="no whole request within the client timeout, or the client closed")
                return
            head = new_head()
            try:
                method, path, body = parse(raw)
            except BadRequest as e:
                self._consume(conn.sock, len(raw))
                return self._write(conn, Plain(e.status, {"error": str(e)}), head,
                                   self._writer(conn.sock, before=before))
            if conn.state is not None:
                conn.state.record(raw, head)
            self._consume(conn.sock, len(raw))
            self._write(conn, self.answer(method, path, body, head), head,
                        self._writer(conn.sock, before=before))
        except BadRequest as e:
            try:
                self._writer(conn.sock, before=before).write(plain_response(e.status, {"error": str(e)}))
            except OSError:
                pass
        except OSError:
            pass  # the client went away
        except Exception as e:  # noqa: BLE001 (a stream whose model failed mid-way)
            self.log(event="answer-failed", name=conn.name, error=repr(e))
        finally:
            self.finish(conn)

    def take_over(self, fetched):
        """The store as the promoted engine fetched it, ``[(name, fd)]``:
        every connection the dead engine held, as Conns with their phase,
        in the order stored. Descriptors of no connection are closed. The
        fetch runs while this engine serves: copies of what it stored
        itself meanwhile (its own names) are closed, the originals are its
        serving loop's."""
        by_name = {}
        own = f"c-{self.boot}-"
        for name, fd in fetched:
            if name.startswith(own):
                os.close(fd)
                continue
            by_name.setdefault(name, []).append(fd)
        out = []
        for name, fds in by_name.items():
            sock, state_fd, rest = None, None, []
            for fd in fds:
                if sock is None and _is_socket(fd):
                    sock = socket.socket(fileno=fd)
                elif state_fd is None and not _is_socket(fd):
                    state_fd = fd
                else:
                    rest.append(fd)
            for fd in rest:
                os.close(fd)
            ours = name.startswith("c-") or is_accepted_name(name)
            if sock is None or not ours:
                if sock is not None:
                    sock.close()
                if state_fd is not None:
                    os.close(state_fd)
                if ours:
                    self.remove(name)
                continue
            if state_fd is not None:
                state = State(state_fd)
            elif is_accepted_name(name):
                # Accepted by the runtime, handed to an engine that died
                # before it stored a state (or to nobody): the request is
                # still in the socket; a state of its own from now on.
                state = self._state_for(name)
            else:
                state = None
            out.append(Conn(sock, name, state, True))
        return out

    def resume(self, conn, timeout=None, before=None):
        """Answers a connection the dead engine held: a request it had not
        recorded is read from the socket; one it had is answered again if
        nothing was written, else continued right after the client's last
        byte; one it had answered is only closed."""
        phase, record, answer, record_len = (read_state(conn.state.fd) if conn.state is not None
                                             else (NEW, None, None, 0))
        self.stats["resumed"] += 1
        if phase == NEW:
            self.stats["unread"] += 1
            # The dead engine may have died waiting for more of the request,
            # its SO_RCVLOWAT raised on this very socket: a wait here would
            # not end with the request all in.
            try:
                conn.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
            except OSError:
                pass
            return self.serve(conn, timeout, before)
        try:
            if phase == DONE:
                self.stats["done"] += 1
                return
            conn.state.record_len = record_len
            raw, head = record["request"], {"id": record["id"], "created": record["created"]}
            # The request, if the dead engine had not consumed it yet.
            self._consume(conn.sock, len(raw), waiting_only=True)
            skip = self.written(conn.sock) if phase == ANSWERING else 0
            self.stats["continued" if skip else "answered_again"] += 1
            if phase == ANSWERING and answer is not None:
                self._writer(conn.sock, skip, before).write(answer)
                conn.state.done()
                return
            method, path, body = parse(raw)
            self._write(conn, self.answer(method, path, body, head), head, self._writer(conn.sock, skip, before),
                        resumed=phase == ANSWERING)
        except OSError:
            pass
        except Exception as e:  # noqa: BLE001 (a record it cannot use, a model that failed)
            self.log(event="resume-failed", name=conn.name, error=repr(e))
        finally:
            self.finish(conn)

    def _writer(self, sock, skip=0, before=None):
        """``before``: this connection's hook before its first byte, else
        the engine's (``before_write``)."""
        return Writer(sock, skip, before or self.before_write)

    def _write(self, conn, reply, head, w, resumed=False):
        state = conn.state
        if isinstance(reply, Stream):
            if state is not None and not resumed:
                state.answering()
            w.write(STREAM_HEAD)
            n = [0]

            def emit(text):
                w.write(token_event(head, text))
                n[0] += 1

            if reply.kv:
                progress = None
                if state is not None:
                    progress = KvProgress(state.fd, read_kv(state.fd) if resumed else None, conn.name)
                try:
                    reply.run(emit, progress)
                finally:
                    if progress is not None:
                        progress.close()
            else:
                reply.run(emit)
            w.write(final_event(head, reply.prompt_tokens, n[0]))
            w.write(DONE_EVENT)
        else:
            data = plain_response(reply.status, reply.body)
            if state is not None and not resumed:
                state.answer(data)
            w.write(data)
        if state is not None:
            state.done()
        if isinstance(reply, Plain) and reply.after is not None:
            conn.sock.shutdown(socket.SHUT_WR)
            reply.after()

    @staticmethod
    def _consume(sock, n, waiting_only=False):
        """Consumes ``n`` bytes of the request; ``waiting_only``: only what
        waits now (a request the dead engine recorded and may or may not
        have read)."""
        # A socket with a timeout waits for data before any recv, whatever
        # its flags: only-what-waits needs it non-blocking for the while.
        saved = sock.gettimeout()
        if waiting_only:
            sock.settimeout(0.0)
        try:
            while n > 0:
                try:
                    got = sock.recv(min(n, 65536))
                except (BlockingIOError, InterruptedError):
                    return
                if not got:
                    return
                n -= len(got)
        finally:
            if waiting_only:
                sock.settimeout(saved)

    def finish(self, conn):
        """Ends a connection: the write side shut down (the client sees the
        end at once, whatever copies the store holds), what the client sent
        since drained (a close with unread bytes would reset), then closed
        and removed from the store."""
        try:
            conn.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        try:
            conn.sock.setblocking(False)
            while conn.sock.recv(65536):
                pass
        except OSError:
            pass
        conn.sock.close()
        if conn.state is not None:
            conn.state.close()
        if conn.stored:
            try:
                self.remove(conn.name)
            except OSError as e:
                self.log(event="fdstore-remove-failed", error=str(e))


def _is_socket(fd):
    try:
        return stat.S_ISSOCK(os.fstat(fd).st_mode)
    except OSError:
        return False
