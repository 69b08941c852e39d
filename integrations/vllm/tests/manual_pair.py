"""A shadow pair of two real vLLMs, by hand: plain processes, no containerd.

What the runtime does for a pair, done here in a few lines: one lock file,
one notify socket (read with SO_PASSCRED: who sent what), one listening
socket bound here and handed to both engines as LISTEN_FDS (descriptor 3,
LISTEN_PID their own pid). Two ``shadow-vllm serve`` engines, each in a
process group of its own; one serves, one parks. Then, ``--kills`` times:
SIGKILL the serving engine's process group (``--kill main``: its main
process only, which the others must follow) and measure, from the kill:

- ``ready``: the parked engine's READY=1;
- ``new_conn``: a connection opened right after the kill, answered
  (GET /v1/models);
- ``completion``: a greedy completion asked right after the kill, answered
  with the very text the pair gave before any kill;

then start the killed slot again and wait until it parks. /dev/shm files
made since the start are counted right after the kill (``shm_files``) and
once the respawn parked (a count that grows by kill means left behind) and removed at the end.

Run it with the virtualenv's python (``make vllm-env vllm-model``):

    target/vllm-venv/bin/python integrations/vllm/tests/manual_pair.py \\
        --model target/vllm-model --kills 3

Two vLLMs take about 8 GB; nothing else of vLLM should run meanwhile.
Everything it starts is killed on exit, whatever happened.
"""

import argparse
import fcntl
import glob
import http.client
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import termios
import threading
import time

PROMPT = "The shadow engine answers while the other one"
MAX_TOKENS = 12
MODEL_NAME = "tiny-llama"


class Notify:
    """The runtime's notify socket: each datagram with its sender's pid."""

    def __init__(self, path):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_PASSCRED, 1)
        self.sock.bind(path)
        self.path = path
        self.events = []  # (monotonic, pid, text)
        self.cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        size = struct.calcsize("3i")
        while True:
            try:
                msg, anc, _, _ = self.sock.recvmsg(4096, socket.CMSG_SPACE(size))
            except OSError:
                return
            pid = None
            for level, kind, data in anc:
                if level == socket.SOL_SOCKET and kind == socket.SCM_CREDENTIALS:
                    pid = struct.unpack("3i", data[:size])[0]
            with self.cond:
                self.events.append((time.monotonic(), pid, msg.decode(errors="replace")))
                self.cond.notify_all()

    def wait(self, pred, timeout, since=0.0):
        """The first event after ``since`` for which pred(pid, text) holds."""
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                for ev in self.events:
                    if ev[0] >= since and pred(ev[1], ev[2]):
                        return ev
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("no such notification in %.0f s" % timeout)
                self.cond.wait(left)


class Engine:
    def __init__(self, slot, args, rt):
        self.slot = slot
        env = dict(os.environ)
        for k in ("WATCHDOG_USEC", "WATCHDOG_PID", "LISTEN_FDS", "LISTEN_PID", "LISTEN_FDNAMES"):
            env.pop(k, None)
        env.update(
            SHADOW_ENGINE_ID=str(slot),
            SHADOW_LOCK_PATH=rt.lock,
            NOTIFY_SOCKET=rt.notify.path,
            LISTEN_FDS="1",
            LISTEN_FDNAMES=f"tcp-{rt.port}",
            VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
            VLLM_NO_USAGE_STATS="1",
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            PYTHONUNBUFFERED="1",
        )
        if args.watchdog_usec:
            env["WATCHDOG_USEC"] = str(args.watchdog_usec)
        fd = rt.listener.fileno()
        serve = [sys.executable, "-m", "shadow_vllm", "serve", args.model, "--served-model-name", MODEL_NAME,
                 "--enforce-eager", "--max-model-len", "256", "--dtype", "float32", *args.vllm_args]
        # LISTEN_PID is the engine's own pid: a shell that execs keeps its pid.
        cmd = ["/bin/sh", "-c", f'LISTEN_PID=$$ exec "$@" 3<&{fd}', "sh", *serve]
        self.log = open(os.path.join(rt.dir, f"engine-{slot}-{time.time():.0f}.log"), "w")
        self.started = time.monotonic()
        self.proc = subprocess.Popen(cmd, env=env, pass_fds=(fd,), stdout=self.log, stderr=subprocess.STDOUT,
                                     start_new_session=True)
        self.pid = self.proc.pid

    def group(self):
        """Pids of its process group still alive (not zombies)."""
        out = []
        for stat in glob.glob("/proc/[0-9]*/stat"):
            try:
                with open(stat) as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == self.pid and fields[0] != "Z":
                out.append(int(stat.split("/")[2]))
        return out

    def kill(self, how):
        if how == "group":
            os.killpg(self.pid, signal.SIGKILL)
        else:
            os.kill(self.pid, signal.SIGKILL)

    def reap(self):
        try:
            os.killpg(self.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()
        self.log.close()


class Runtime:
    def __init__(self):
        self.dir = tempfile.mkdtemp(prefix="shadow-vllm-pair-")
        self.lock = os.path.join(self.dir, "engine.lock")
        open(self.lock, "w").close()
        self.notify = Notify(os.path.join(self.dir, "notify.sock"))
        self.listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(4096)
        self.port = self.listener.getsockname()[1]


def request(port, method, path, body=None, timeout=120):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request(method, path, body=json.dumps(body) if body is not None else None,
                  headers={"Content-Type": "application/json"})
        r = c.getresponse()
        data = r.read()
        return r.status, data
    finally:
        c.close()


def complete(port):
    status, data = request(port, "POST", "/v1/completions",
                           {"model": MODEL_NAME, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0})
    if status != 200:
        raise RuntimeError(f"completion: HTTP {status}: {data[:300]!r}")
    return json.loads(data)["choices"][0]["text"]


def shm_files():
    """The engines' /dev/shm files: with SHADOW_ENGINE_ID set, shadow-vllm
    names them after the slot (shadow_vllm.shm); other programs' psm_* and
    sem.mp-* files are not counted."""
    return sorted(set(glob.glob("/dev/shm/psm_shadow*") + glob.glob("/dev/shm/sem.mp-shadow*")))


def rss_mib(pids):
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
        except OSError:
            pass
    return total // 1024


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--kills", type=int, default=3)
    ap.add_argument("--kill", choices=("group", "main"), default="group")
    ap.add_argument("--watchdog-usec", type=int, default=0,
                    help="WATCHDOG_USEC for the engines; with it, the watchdog check below runs first")
    ap.add_argument("--start-timeout", type=float, default=600)
    ap.add_argument("--json", help="write the figures here too")
    ap.add_argument("vllm_args", nargs="*", help="more arguments for vllm serve (after --)")
    args = ap.parse_args()
    args.model = os.path.abspath(args.model)

    shm_before = set(shm_files())
    rt = Runtime()
    print(f"pair dir {rt.dir}, port {rt.port}", flush=True)
    engines = {}
    rounds = []
    try:
        for slot in (0, 1):
            engines[slot] = Engine(slot, args, rt)
        ready = rt.notify.wait(lambda pid, t: "READY=1" in t, args.start_timeout)
        active = next(s for s, e in engines.items() if e.pid == ready[1])
        shadow = 1 - active
        rt.notify.wait(lambda pid, t: pid == engines[shadow].pid and "STATUS=parked" in t, args.start_timeout)
        print(f"slot {active} serves ({ready[0] - engines[active].started:.1f} s to READY), "
              f"slot {shadow} parked ({time.monotonic() - engines[shadow].started:.1f} s)", flush=True)
        reference = complete(rt.port)
        print(f"reference completion: {reference!r}", flush=True)
        for e in engines.values():
            print(f"slot {e.slot}: pids {sorted(e.group())}, RSS {rss_mib(e.group())} MiB", flush=True)

        if args.watchdog_usec:
            check_watchdog(rt, engines[active], engines[shadow], args.watchdog_usec / 1e6)
        for n in range(args.kills):
            victim, heir = engines[active], engines[shadow]
            group = victim.group()
            results = {}

            def new_conn(t0):
                status, _ = request(rt.port, "GET", "/v1/models")
                results["new_conn"] = (time.monotonic() - t0, status)

            def first_completion(t0):
                text = complete(rt.port)
                results["completion"] = (time.monotonic() - t0, text)

            t0 = time.monotonic()
            victim.kill(args.kill)
            threads = [threading.Thread(target=f, args=(t0,)) for f in (new_conn, first_completion)]
            for t in threads:
                t.start()
            ev = rt.notify.wait(lambda pid, t: pid == heir.pid and "READY=1" in t, 120, since=t0)
            for t in threads:
                t.join(120)
            gone_by = None
            deadline = time.monotonic() + 10
            while time.monotonic() < deadline:
                if not any(os.path.exists(f"/proc/{p}") and _alive(p) for p in group):
                    gone_by = time.monotonic() - t0
                    break
                time.sleep(0.005)
            victim.reap()
            r = {
                "kill": n + 1,
                "how": args.kill,
                "ready_ms": round((ev[0] - t0) * 1000, 1),
                "new_conn_ms": round(results["new_conn"][0] * 1000, 1),
                "new_conn_status": results["new_conn"][1],
                "completion_ms": round(results["completion"][0] * 1000, 1),
                "completion_identical": results["completion"][1] == reference,
                "victim_processes": len(group),
                "victim_gone_ms": None if gone_by is None else round(gone_by * 1000, 1),
                # /dev/shm files made since the start that are still there:
                # the live engines' own and what the dead ones left.
                "shm_files": len(set(shm_files()) - shm_before),
            }
            rounds.append(r)
            print(json.dumps(r), flush=True)
            if not r["completion_identical"]:
                print(f"  different text: {results['completion'][1]!r}", flush=True)
            # Respawn the killed slot; it parks behind the new active one.
            engines[victim.slot] = Engine(victim.slot, args, rt)
            active, shadow = heir.slot, victim.slot
            parked = rt.notify.wait(lambda pid, t: pid == engines[shadow].pid and "STATUS=parked" in t,
                                    args.start_timeout)
            print(f"slot {shadow} respawned and parked in {parked[0] - engines[shadow].started:.1f} s; "
                  f"/dev/shm files now {len(set(shm_files()) - shm_before)}", flush=True)
            if complete(rt.port) != reference:
                raise RuntimeError("the pair's answer changed")
    finally:
        for e in engines.values():
            e.reap()
        leftovers = sorted(set(shm_files()) - shm_before)
        print(f"/dev/shm left by the engines: {len(leftovers)} {leftovers[:6]}", flush=True)
        for f in leftovers:
            try:
                os.unlink(f)
            except OSError:
                pass
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rounds, f, indent=1)
    ok = all(r["completion_identical"] and r["new_conn_status"] == 200 for r in rounds)
    return 0 if ok else 1


def _comm(pid):
    try:
        with open(f"/proc/{pid}/comm") as f:
            return f.read().strip()
    except OSError:
        return "?"


def check_watchdog(rt, active, shadow, interval):
    """Who pings, and that a stopped EngineCore stops the serving engine's
    pings: the serving engine's pings come from its EngineCore's busy loop
    (the API server pings only while parked, from its wait for the lock)."""
    window = 4 * interval

    def pings(since, until):
        with rt.notify.cond:
            evs = [e for e in rt.notify.events if since <= e[0] < until and e[2] == "WATCHDOG=1"]
        out = {}
        for _, pid, _ in evs:
            out[pid] = out.get(pid, 0) + 1
        return out

    def who(counts, engine):
        mine = set(engine.group())
        return {f"{_comm(pid)}[{pid}]": n for pid, n in counts.items() if pid in mine}

    t0 = time.monotonic()
    time.sleep(window)  # the window pings are counted in, not a wait for an event
    t1 = time.monotonic()
    seen = pings(t0, t1)
    print(f"watchdog: pings in {window:.1f} s: serving {who(seen, active)}, parked {who(seen, shadow)}", flush=True)
    core = [p for p in active.group() if _comm(p).startswith("VLLM::EngineCor")]
    if not core:
        raise RuntimeError("no EngineCore process found in the serving engine's group")
    os.kill(core[0], signal.SIGSTOP)
    try:
        # Stopped, and every datagram sent before the stop read: a ping
        # from before the stop cannot land in the window.
        _until(f"EngineCore {core[0]} stopped", lambda: _state(core[0]) == "T", 10)
        _until("the notify socket drained", lambda: _queued(rt.notify.sock) == 0, 10)
        t2 = time.monotonic()
        time.sleep(window)  # the window, as above
        stopped = pings(t2, time.monotonic())
    finally:
        os.kill(core[0], signal.SIGCONT)
    print(f"watchdog: EngineCore {core[0]} stopped for {window:.1f} s: serving {who(stopped, active)}, "
          f"parked {who(stopped, shadow)}", flush=True)
    if who(stopped, active) or not who(seen, active):
        raise RuntimeError("the serving engine's pings do not follow its EngineCore")


def _state(pid):
    """The one-letter state of /proc/PID/stat (None once gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def _queued(sock):
    """Bytes of the next datagram waiting on ``sock`` (0: none)."""
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.FIONREAD, b"\0\0\0\0"))[0]


def _until(what, pred, limit_s, step_s=0.005):
    deadline = time.monotonic() + limit_s
    while not pred():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out after {limit_s} s waiting for {what}")
        time.sleep(step_s)


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


if __name__ == "__main__":
    sys.exit(main())
