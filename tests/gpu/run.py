#!/usr/bin/env python3
"""GPU tests of GMS on a real NVIDIA GPU (`make test-gpu`).

Needs only python3 + torch on the GPU machine and prebuilt binaries
(`make gpu-bundle` puts gmsd, gms-cuda-bench and libgms.so in .device/).
Every process a test starts is registered and killed when the test ends,
whatever happens, and each test is followed by a check that nothing of it
is left (processes, containers and tasks of the shared containerd, mounts,
pair directories): what is left is cleared and fails that test, so the
next one starts clean in any order. Every wait has a deadline. A test
that cannot run on the machine (TP=2 on one GPU) says `skip` and why. The
last line is "N passed, M failed, K skipped"; the exit status is non-zero
on any failure.

  python3 tests/gpu/run.py [--bin-dir .device] [--only NAME[,NAME]] [--part K/N] [--quick] [--own-port]
                           [--engine PATH]

--only runs the tests whose names contain any NAME; --part K/N runs the
K-th of N parts of the list (every test in exactly one part: a whole run
spread over N calls of a device machine). The device-memory check runs
last in every selection. --engine runs another engine.py in the pair
tests (a copy of an earlier one: its figures before a change); it must
lie in this repository, next to its continuity.py and heartbeat.py, two
levels below the root.

The torch-engine failover test plays the runtime's part of
`shadow.dev/listen`: it owns the listening socket and hands it to both
engines (LISTEN_FDS), and asserts that no connection is refused through
the SIGKILL; `--own-port` lets the engines bind the port themselves
instead (the contrast: refusals and retries).
"""

import glob
import http.client
import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback

import ctr_pair

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.abspath(os.path.join(HERE, "..", ".."))
ARGS = sys.argv[1:]
BIN = os.path.abspath(ARGS[ARGS.index("--bin-dir") + 1] if "--bin-dir" in ARGS else os.path.join(ROOT, ".device"))
ONLY = ARGS[ARGS.index("--only") + 1].split(",") if "--only" in ARGS else None
PART = tuple(int(x) for x in ARGS[ARGS.index("--part") + 1].split("/")) if "--part" in ARGS else None
QUICK = "--quick" in ARGS
OWN_PORT = "--own-port" in ARGS
WORKER = os.path.join(HERE, "worker.py")
ENGINE = os.path.abspath(ARGS[ARGS.index("--engine") + 1] if "--engine" in ARGS
                         else os.path.join(ROOT, "examples", "torch-engine", "engine.py"))
FIGURES = []


class Skipped(Exception):
    """The test cannot run on this machine; the message says why."""


def figure(name, value, unit, target=None):
    line = f"FIGURE {name}: {value} {unit}"
    if target is not None:
        line += f" (target {target})"
    FIGURES.append(line)
    print(line, flush=True)


class Proc:
    """A child with a line queue of its stdout; stderr goes to a log file."""

    def __init__(self, name, cmd, env=None, stdin=True, pass_fds=()):
        self.name = name
        self.log_path = os.path.join(Session.dir, f"{name}.stderr")
        self.err = open(self.log_path, "w")
        full_env = dict(os.environ, PYTHONUNBUFFERED="1", GMS_LIB=os.path.join(BIN, "libgms.so"))
        full_env.update(env or {})
        self.p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=self.err,
                                  stdin=subprocess.PIPE if stdin else subprocess.DEVNULL,
                                  env=full_env, text=True, start_new_session=True, pass_fds=pass_fds)
        self.lines = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()
        Session.procs.append(self)

    def _pump(self):
        for line in self.p.stdout:
            self.lines.put(line.rstrip("\n"))
        self.lines.put(None)

    @property
    def pid(self):
        return self.p.pid

    def expect(self, pred, timeout, what):
        """The first line (parsed as JSON when it is) for which pred is true."""
        deadline = time.monotonic() + timeout
        seen = []
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"{self.name}: no {what} within {timeout}s; saw {seen[-5:]}; stderr: {self.stderr_tail()}")
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                continue
            if line is None:
                raise AssertionError(f"{self.name} ended (rc {self.p.wait()}) before {what}; saw {seen[-5:]}; stderr: {self.stderr_tail()}")
            seen.append(line)
            try:
                obj = json.loads(line)
            except ValueError:
                obj = line
            if pred(obj):
                return obj

    def event(self, name, timeout=120):
        return self.expect(lambda o: isinstance(o, dict) and o.get("event") == name, timeout, f"event {name}")

    def send(self, line):
        self.p.stdin.write(line + "\n")
        self.p.stdin.flush()

    def wait(self, timeout):
        return self.p.wait(timeout=timeout)

    def kill(self, sig=signal.SIGKILL):
        if self.p.poll() is None:
            try:
                os.killpg(self.p.pid, sig)
            except ProcessLookupError:
                pass

    def stderr_tail(self):
        if not self.err.closed:
            self.err.flush()
        try:
            with open(self.log_path) as f:
                return f.read()[-1500:]
        except OSError:
            return ""


class Session:
    dir = None
    procs = []
    runtime = None

    @classmethod
    def end_test(cls):
        """Ends whatever the test that just ran started, and says what it
        had left: a list of what had to be cleared (empty: nothing). The
        shared containerd stays up for the next test, unless it died."""
        left = []
        for p in reversed(cls.procs):
            if p.p.poll() is None:
                p.kill(signal.SIGTERM if p.name.startswith("gmsd") else signal.SIGKILL)
        for p in reversed(cls.procs):
            try:
                p.p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.p.wait(timeout=10)
            p.err.close()
        cls.procs = []
        rt = cls.runtime
        if rt is not None and not rt.alive():
            left.append(f"containerd ended (rc {rt.p.poll()}): {rt.log_tail(1500)}")
            rt.stop()
            cls.runtime = rt = None
        if rt is not None:
            tasks = rt.ctr("task", "ls", "-q", check=False).stdout.split()
            for cid in tasks:
                rt.ctr("task", "kill", "--signal", "SIGKILL", cid, check=False)
            for cid in tasks:
                try:
                    poll_until(lambda: rt.task(cid) is None or rt.task(cid)[1] == "STOPPED", 30,
                               f"task {cid} stopped")
                except AssertionError:
                    pass
                rt.ctr("task", "rm", "-f", cid, check=False)
            containers = rt.ctr("containers", "ls", "-q", check=False).stdout.split()
            for cid in containers:
                rt.ctr("containers", "rm", cid, check=False)
            if tasks or containers:
                left.append(f"tasks {tasks}, containers {containers}")
        markers = [ENGINE, os.path.join(BIN, "gmsd"), WORKER] + ([rt.address, rt.state_dir] if rt else [])
        procs = ctr_pair.our_processes(markers)
        if procs:
            left.append(f"processes {procs}")
            for pid in procs:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            try:
                poll_until(lambda: not ctr_pair.our_processes(markers), 30, "leftover processes gone")
            except AssertionError:
                left.append(f"still there: {ctr_pair.our_processes(markers)}")
        if "baseline_mib" in STATE:
            seen = []
            try:
                poll_until(lambda: (lambda m: seen.append(m) or m <= STATE["baseline_mib"] + 64)(gpu_used_mib()),
                           30, "device memory back")
            except AssertionError:
                left.append(f"device memory {seen[-1]} MiB, was {STATE['baseline_mib']} MiB: {app_mib()}")
        if rt is not None:
            mounts = ctr_pair.mounts_under(rt.base)
            pairs = glob.glob(os.path.join(glob.escape(rt.state_dir), "*", ctr_pair.NS, "*"))
            if mounts or pairs:
                left.append(f"mounts {mounts}, pair dirs {pairs}")
            for d in pairs:
                shutil.rmtree(d, ignore_errors=True)
        return left

    @classmethod
    def cleanup(cls):
        cls.end_test()
        if cls.runtime is not None:
            cls.runtime.stop()
            cls.runtime = None


def runtime():
    """The private containerd the containerd tests share, started on first
    use (and again if it died)."""
    rt = Session.runtime
    if rt is None or not rt.alive():
        if rt is not None:
            rt.stop()
        rt = Session.runtime = ctr_pair.Runtime(tempfile.mkdtemp(prefix="c", dir=Session.dir), BIN, ROOT)
    return rt


def gmsd(name, max_bytes="120G", lock=None):
    d = tempfile.mkdtemp(prefix=f"{name}-", dir=Session.dir)
    os.chmod(d, 0o700)
    extra = ["--lock", lock] if lock else []
    g = Proc(f"gmsd-{name}", [os.path.join(BIN, "gmsd"), "serve", "--socket-dir", d, "--device", "0",
                               "--max-bytes", max_bytes, *extra], stdin=False)
    line = g.expect(lambda o: isinstance(o, str) and o.startswith("ready "), 30, "ready line")
    g.socket, g.socket_dir = line.split(" ", 1)[1], d
    return g


def status(g):
    out = subprocess.run([os.path.join(BIN, "gmsd"), "status", "--socket", g.socket, "--json"],
                         capture_output=True, text=True, timeout=10)
    assert out.returncode == 0, f"gmsd status: {out.stderr}"
    return json.loads(out.stdout)


def worker(name, g, *args):
    return Proc(name, [sys.executable, WORKER, *args], env={"GMS_SOCKET_DIR": g.socket_dir})


def poll_until(pred, timeout, what):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = pred()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"not within {timeout}s: {what}")


def smi(*query):
    out = subprocess.run(["nvidia-smi", *query, "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, timeout=20)
    return out.stdout.strip()


def memory_back(baseline):
    """Waits until the GPU's used memory is back within 64 MiB of
    ``baseline``; returns it (MiB)."""
    seen = []
    try:
        poll_until(lambda: (lambda m: seen.append(m) or m <= baseline + 64)(gpu_used_mib()), 60,
                   "device memory back to the start")
    except AssertionError:
        raise AssertionError(f"device memory {seen[-1]} MiB, was {baseline} MiB: {app_mib()}") from None
    return seen[-1]


def gpu_used_mib():
    return int(smi("--query-gpu=memory.used", "-i", "0").splitlines()[0])


def app_mib():
    """pid -> MiB used on the GPU, per nvidia-smi --query-compute-apps."""
    out = {}
    for line in smi("--query-compute-apps=pid,used_memory").splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit():
            out[int(parts[0])] = int(parts[1]) if parts[1].isdigit() else parts[1]
    return out


# --- tests -------------------------------------------------------------------
STATE = {}


def shared_layout():
    """A gmsd with a committed layout, its writer and one reader mapping it;
    (gmsd, writer, reader, the writer's "committed" line). Each of the
    first three tests makes its own: a test leaves no process behind."""
    g = gmsd("shared")
    w = worker("writer", g, "writer")
    assert w.event("lease")["lease"] == "rw"
    committed = w.event("committed")
    r = worker("reader1", g, "reader")
    assert r.event("values")["equal_to_recomputed"], "reader sees other values than the writer wrote"
    mapped = r.event("mapped")
    assert mapped["ptrs"] == committed["ptrs"], (mapped["ptrs"], committed["ptrs"])
    assert mapped["sums"] == committed["sums"]
    STATE["sums"], STATE["ptrs"] = committed["sums"], committed["ptrs"]
    return g, w, r, committed


def test_writer_then_reader_same_values_same_addresses():
    g, _, _, _ = shared_layout()
    st = status(g)
    assert st["backend"] == "cuda" and st["device"].startswith("GPU-"), st
    assert st["state"] == "committed" and len(st["leases"]) == 2, st
    text = subprocess.run([os.path.join(BIN, "gmsd"), "status", "--socket", g.socket],
                          capture_output=True, text=True, timeout=10).stdout
    assert "cuda device GPU-" in text and "NVIDIA" in text, text
    assert os.path.basename(g.socket) == f"gms-{st['device']}.sock", g.socket


def test_sigkill_writer_reader_unaffected_new_reader_same_values():
    g, w, r, _ = shared_layout()
    w.kill()
    w.wait(20)
    r.send("check")
    assert r.event("check")["sums"] == STATE["sums"], "reader's bytes changed after the writer died"
    r2 = worker("reader2", g, "reader")
    assert r2.event("values")["equal_to_recomputed"]
    m = r2.event("mapped")
    assert m["sums"] == STATE["sums"] and m["ptrs"] == STATE["ptrs"]
    r2.send("quit")
    assert r2.wait(30) == 0


def test_read_only_write_fails_that_reader_alone():
    g, _, r, _ = shared_layout()
    bad = worker("reader-write", g, "reader-write")
    bad.event("mapped")
    ev = bad.expect(lambda o: isinstance(o, dict) and o.get("event") in ("write_failed", "write_succeeded"),
                    60, "write outcome")
    assert ev["event"] == "write_failed", "a write through a read-only GMS mapping succeeded"
    print(f"  reader-write failed as it should: {ev['error']}")
    assert bad.wait(30) != 0
    assert g.p.poll() is None, "gmsd died"
    r.send("check")
    assert r.event("check")["sums"] == STATE["sums"], "bytes changed by a read-only reader's write"
    r3 = worker("reader3", g, "reader")
    assert r3.event("mapped")["sums"] == STATE["sums"]
    r3.send("quit")
    r3.wait(30)
    assert len(status(g)["leases"]) == 2  # the writer's and reader1's


def test_weights_changed_through_a_cuda_handle_are_found_by_the_digest():
    """On CUDA a reader can make its mapping read-write (docs/security.md):
    the digest recorded at commit is what notices."""
    g = gmsd("digest")
    w = worker("digest-writer", g, "writer")
    committed = w.event("committed")
    v = worker("verify-clean", g, "verify")
    ok = v.event("verified")
    assert ok.get("checked", True) and ok["allocations"] > 0, ok
    v.wait(30)
    figure(f"weights digest recomputed on the GPU ({ok['bytes'] >> 20} MiB, {ok['allocations']} allocations)",
           ok["ms"], "ms")
    bad = worker("scribbler", g, "scribble", "--tensor", "a")
    ev = bad.expect(lambda o: isinstance(o, dict) and o.get("event") in ("scribbled", "scribble_refused"),
                    60, "scribble outcome")
    bad.wait(30)
    if ev["event"] == "scribble_refused":
        # Then CUDA itself keeps imported weights read-only: nothing to find.
        figure("cuMemSetAccess(READWRITE) on an imported read-only mapping", f"refused (rc {ev['rc']})", "")
        w.send("check")
        assert w.event("check")["sums"] == committed["sums"], "the weights changed all the same"
    else:
        assert ev["changed"], ev
        figure("cuMemSetAccess(READWRITE) on an imported read-only mapping", "allowed: the weights changed", "")
        v = worker("verify-changed", g, "verify")
        found = v.expect(lambda o: isinstance(o, dict) and o.get("event") in ("verified", "corrupt"), 60,
                         "verify outcome")
        v.wait(30)
        assert found["event"] == "corrupt", f"a changed tensor was not found: {found}"
        assert found["allocations"] == [str(ev["allocation"])], found
    w.send("quit")
    w.wait(30)
    g.kill(signal.SIGTERM)
    assert g.wait(60) == 0


def test_rw_or_ro_and_discard_before_commit():
    g = gmsd("discard")
    early = worker("ro-before-commit", g, "reader")
    assert early.wait(60) != 0, "an ro lease was granted with no committed layout"
    for how in ("--exit-before-commit", "--hold-before-commit"):
        w = worker(f"writer{how}", g, "writer", how)
        assert w.event("lease")["lease"] == "rw"
        filled = w.event("filled")
        assert filled["layout_bytes"] > 0
        if how == "--hold-before-commit":
            assert status(g)["state"] == "loading"
            w.kill()
        w.wait(30)
        st = poll_until(lambda: (lambda s: s if s["state"] == "empty" else None)(status(g)), 10,
                        "discarded layout after the writer ended")
        assert st["bytes"] == 0 and st["allocations"] == 0, st
    w = worker("writer-commits", g, "writer")
    assert w.event("lease")["lease"] == "rw"
    sums = w.event("committed")["sums"]
    w.send("quit")
    w.wait(30)
    second = worker("writer-gets-ro", g, "writer")
    assert second.event("lease")["lease"] == "ro", "rw_or_ro after a commit must be ro"
    assert second.event("mapped")["sums"] == sums
    second.send("quit")
    second.wait(30)
    g.kill(signal.SIGTERM)
    assert g.wait(60) == 0


def test_vllm_loader_gms_part():
    """shadow-vllm's `--load-format gms`, its GMS part on CUDA: vLLM's CUDA
    build cannot run here, but `shadow_vllm.loader.load_through_gms` (what
    the loader does with its lease) imports no vLLM. Two engines as two
    processes (integrations/vllm/tests/gms_child.py): the writer builds on
    the GPU, loads a checkpoint, publishes and commits; the reader builds
    on 'meta' without the checkpoint, maps the same pages at the same
    address and checks the digest; both keep the small tensors private."""
    g = gmsd("vllm-loader")
    child = os.path.join(ROOT, "integrations", "vllm", "tests", "gms_child.py")
    env = {"GMS_SOCKET_DIR": g.socket_dir,
           "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "gms", "python"),
                                          os.path.join(ROOT, "integrations", "vllm")])}
    ckpt = os.path.join(g.socket_dir, "..", "vllm-loader-ckpt.pt")
    subprocess.run([sys.executable, "-c",
                    "import sys, torch; gen = torch.Generator().manual_seed(33); "
                    "torch.save({'proj.weight': torch.randn(512, 1024, generator=gen), "
                    "'norm': torch.randn(512, generator=gen), 'scale': torch.tensor(0.5)}, sys.argv[1])",
                    ckpt], check=True, timeout=120)
    w = Proc("vllm-loader-writer", [sys.executable, child, "write", ckpt, "--device", "0"], env=env)
    wrote = w.expect(lambda o: isinstance(o, dict) and "tensors" in o, 120, "the writer's report")
    os.unlink(ckpt)  # the reader must not need it
    r = Proc("vllm-loader-reader", [sys.executable, child, "read", "--device", "0"], env=env)
    read = r.expect(lambda o: isinstance(o, dict) and "tensors" in o, 120, "the reader's report")
    assert wrote["devices"] == read["devices"] == ["cuda"], (wrote["devices"], read["devices"])
    assert wrote["lease"] == read["lease"] == "ro", "the writer goes on as a reader after its commit"
    assert wrote["shared"] == read["shared"] == ["proj.weight"], (wrote["shared"], read["shared"])
    assert read["ptrs"]["proj.weight"] == wrote["ptrs"]["proj.weight"], "not mapped at the writer's address"
    for small in ("norm", "scale"):
        assert read["ptrs"][small] != wrote["ptrs"][small], f"{small} is not each engine's own"
    assert read["tensors"] == wrote["tensors"] and read["output"] == wrote["output"]
    assert read["check"]["allocations"] == 1, read["check"]
    assert read["copied"][0] == 2 and read["norm_kept"] == ["Tagged", "kept"], read
    figure("vLLM loader's GMS part on CUDA: reader's digest check", read["check"]["ms"], "ms")
    for p in (w, r):
        p.send("")
        assert p.wait(60) == 0, f"{p.name} exited {p.p.returncode}"
    g.kill(signal.SIGTERM)
    assert g.wait(60) == 0


def test_measure_attach_and_kv_from_rust_and_python():
    wg, kvg = (4, 8) if QUICK else (32, 64)
    g = gmsd("bench")
    b = Proc("gms-cuda-bench", [os.path.join(BIN, "gms-cuda-bench"), "--socket-dir", g.socket_dir,
                                "--weights-gib", str(wg), "--kv-gib", str(kvg), "--readers", "3"], stdin=False)
    attach, kv = [], []
    while True:
        line = b.expect(lambda o: True, 180, "bench output")
        print(f"  rust: {line}")
        if isinstance(line, dict) and line.get("step") == "attach":
            attach.append(line["import_map_ms"])
        if isinstance(line, dict) and line.get("step") == "kv":
            kv.append(line["materialise_ms"])
            if len(kv) == 3:
                break
    assert b.wait(60) == 0, b.stderr_tail()
    figure(f"rust attach (import+map) of {wg} GiB, 3 fresh reader processes", attach, "ms", "<= 5 ms")
    figure(f"rust KV materialise {kvg} GiB", kv, "ms", "<= 20 ms")
    py = []
    for i in range(2):
        m = worker(f"py-measure{i}", g, "measure", "--kv-gib", str(kvg))
        ev = m.event("measure", 120)
        print(f"  python: {ev}")
        py.append(ev)
        assert m.wait(60) == 0
        assert ev["bytes"] == wg << 30
    figure(f"python attach (gms_import) of {wg} GiB", [e["import_map_ms"] for e in py], "ms", "<= 5 ms")
    figure(f"python KV materialise {kvg} GiB", [e["kv_materialise_ms"] for e in py], "ms", "<= 20 ms")
    st = status(g)
    assert st["resident_bytes"] == wg << 30 and not st["leases"], st
    g.kill(signal.SIGTERM)
    assert g.wait(60) == 0


def test_kv_pool_outlives_its_writer_behind_a_fence():
    """The pair's KV pool on the device: gmsd's memory, the lock holder's
    to write. The first engine fills it and is SIGKILLed under a second of
    queued GPU writes into its last block; the next (parked on the lock)
    is granted the pool at once, at the same address, with what the first
    committed in it, and a fence that passes only once the dead engine's
    context is torn down: the writes that land meanwhile are the hazard
    the fence guards against."""
    lock = os.path.join(Session.dir, "kv-pool.lock")
    open(lock, "w").close()
    g = gmsd("kvpool", lock=lock)
    a = Proc("kv-a", [sys.executable, WORKER, "kv-pool", "--lock", lock, "--kv-gib", "4"],
             env={"GMS_SOCKET_DIR": g.socket_dir})
    first = a.event("granted")
    assert first["created"] and first["fenced"], first
    b = Proc("kv-b", [sys.executable, WORKER, "kv-pool", "--lock", lock, "--kv-gib", "4"],
             env={"GMS_SOCKET_DIR": g.socket_dir})
    b.event("parked")
    a.send("spin")
    a.event("spinning")
    time.sleep(0.2)
    killed = time.monotonic()
    a.kill()
    second = b.event("granted")
    assert not second["created"], second
    assert second["pool"] == first["pool"] and second["addr"] == first["addr"], (first, second)
    assert second["carried"], "what the first engine wrote is not in the pool"
    b.send("fence")
    fence = b.event("fence", timeout=60)
    assert fence["passed"], fence
    figure("kv_pool_lock_after_kill", round((second["locked"] - killed) * 1e3, 2), "ms")
    figure("kv_pool_grant", second["grant_ms"], "ms")
    figure("kv_pool_granted_after_kill", round((second["granted"] - killed) * 1e3, 2), "ms")
    figure("kv_pool_fence_after_kill", round((fence["at"] - killed) * 1e3, 2), "ms")
    figure("kv_pool_dead_writes_after_grant", fence["tail"] - fence["tail_at_grant"], "writes")
    st = status(g)
    assert st["kv"]["grants"] == 2 and st["kv"]["fence_waits_for"] == 0, st["kv"]
    b.send("quit")
    b.wait(30)


def test_kv_wake_grows_as_device_memory_comes_back():
    """libgms's progressive wake on a full GPU: another process holds all
    but 5 GiB, a 24 GiB KV cache wakes with what fits (2 GiB chunks) and
    grows to all of it once that process is killed and its memory comes
    back; its last chunk is usable from torch."""
    g = gmsd("kvwake")
    kv_gib, leave = 24, 5
    h = worker("hog", g, "hog", "--leave-gib", str(leave))
    held = h.event("hogging", 120)
    w = worker("kv-wake", g, "kv-wake", "--kv-gib", str(kv_gib))
    woken = w.event("woken", 120)
    print(f"  hog: {held}\n  woken: {woken}", flush=True)
    assert woken["growth"] == "growing", woken
    assert 0 < woken["backed"] <= (leave + 1) << 30 and woken["backed"] % (2 << 30) == 0, woken
    assert woken["wake_ms"] < 1000, woken
    kill_at = time.perf_counter()
    h.kill()
    w.send("wait")
    grown = w.event("grown", 60)
    full_ms = (time.perf_counter() - kill_at) * 1e3
    print(f"  grown: {grown}", flush=True)
    assert grown["growth"] == "backed" and grown["backed"] == kv_gib << 30 and grown["last_byte"] == 1, grown
    figure(f"KV wake of {kv_gib} GiB with {leave} GiB free: returned after / backed at once",
           f"{woken['wake_ms']} ms / {woken['backed'] >> 30} GiB", "")
    figure(f"KV wake of {kv_gib} GiB: SIGKILL of the process holding the memory -> all of it backed",
           round(full_ms, 1), "ms")
    w.send("quit")
    assert w.wait(60) == 0, w.stderr_tail()
    g.kill(signal.SIGTERM)
    assert g.wait(60) == 0


class Notifications:
    """The NOTIFY_SOCKET side: collects sd_notify datagrams."""

    def __init__(self, path):
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.sock.bind(path)
        self.msgs = queue.Queue()
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self):
        while True:
            try:
                data = self.sock.recv(4096)
            except OSError:
                return
            fields = dict(l.split("=", 1) for l in data.decode().splitlines() if "=" in l)
            fields["_at"] = time.time()
            self.msgs.put(fields)

    def ready(self, timeout):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                m = self.msgs.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                break
            if m.get("READY") == "1":
                return m
        raise AssertionError(f"no READY=1 within {timeout}s")


def request(port, prompt="hello shadow", timeout=5.0, max_tokens=4):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        c.request("POST", "/v1/completions", json.dumps({"prompt": prompt, "max_tokens": max_tokens}),
                  {"Content-Type": "application/json"})
        resp = c.getresponse()
        body = json.loads(resp.read())
        if resp.status != 200:
            raise OSError(f"HTTP {resp.status}")
        return body
    finally:
        c.close()


def test_torch_engine_failover():
    d = tempfile.mkdtemp(prefix="pair-", dir=Session.dir)
    # gmsd grants the KV pool to the holder of this lock (as the shim
    # starts it for a pair).
    open(os.path.join(d, "engine.lock"), "w").close()
    g = gmsd("engines", lock=os.path.join(d, "engine.lock"))
    notes = Notifications(os.path.join(d, "notify.sock"))
    port = 18000 + os.getpid() % 1000
    env = {"SHADOW_LOCK_PATH": os.path.join(d, "engine.lock"), "NOTIFY_SOCKET": os.path.join(d, "notify.sock"),
           "GMS_SOCKET_DIR": g.socket_dir, "ENGINE_PORT": str(port),
           "ENGINE_LAYERS": "2" if QUICK else "8", "ENGINE_KV_GIB": "2" if QUICK else "8"}
    engines = {}
    listener = None
    if not OWN_PORT:
        # What the shim does for shadow.dev/listen: one socket for the pair,
        # listening before any engine runs, descriptor 3 of every engine,
        # LISTEN_PID the engine's own pid (the shell execs the engine).
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", port))
        listener.listen(4096)
    for slot in ("0", "1"):
        cmd, fds = [sys.executable, ENGINE], ()
        if listener is not None:
            n = listener.fileno()
            cmd = ["bash", "-c", f'exec 3<&{n} {n}<&-; LISTEN_PID=$$ LISTEN_FDS=1 LISTEN_FDNAMES=tcp-{port} exec "$@"',
                   "bash"] + cmd
            fds = (n,)
        e = Proc(f"engine{slot}", cmd, env=dict(env, SHADOW_ENGINE_ID=slot), stdin=False, pass_fds=fds)
        engines[e.pid] = e
    weights, parked = {}, {}
    for pid, e in engines.items():
        weights[pid] = e.event("weights", 240)
        print(f"  {e.name} weights: {weights[pid]}")
    for pid, e in engines.items():
        parked[pid] = e.event("parked", 240)
        print(f"  {e.name} parked: {parked[pid]}", flush=True)
    w0, w1 = weights.values()
    assert w0["addr"] == w1["addr"], "engines do not share the weights' address"
    assert sorted([w0["source"], w1["source"]]) == ["generated+committed", "mapped read-only"], weights
    loader = next(pid for pid, w in weights.items() if w["source"] == "generated+committed")
    figure("cold start of the loading engine (process start -> parked)", parked[loader]["init_s"], "s")
    figure("start of the mapping engine (process start -> parked)",
           next(p["init_s"] for pid, p in parked.items() if pid != loader), "s")
    ready = notes.ready(240)
    active = engines[int(ready["MAINPID"])]
    shadow = next(e for pid, e in engines.items() if e is not active)
    act_ev = active.event("active", 60)
    assert act_ev.get("socket") == ("own" if OWN_PORT else "inherited"), act_ev
    first = request(port)
    assert first["pid"] == active.pid
    apps = app_mib()
    figure("device memory of the parked shadow (nvidia-smi per pid)", apps.get(shadow.pid), "MiB")
    figure("device memory of the active engine (nvidia-smi per pid)", apps.get(active.pid), "MiB")
    figure("device memory held by gmsd (weights, counted in no engine)", status(g)["resident_bytes"] >> 20, "MiB")
    figure("wake (weights check launched) of the first active engine", act_ev["wake_ms"], "ms")

    # Steady request stream; SIGKILL the active after it has served a while.
    stop, results, kinds = threading.Event(), [], {"refused": 0, "reset_in_flight": 0, "timeouts": 0}

    def stream():
        while not stop.is_set():
            t = time.time()
            try:
                body = request(port, timeout=2.0)
                results.append((t, time.time(), body["pid"], body["choices"][0]["tokens"]))
            except (OSError, http.client.HTTPException, ValueError) as e:
                kind = ("refused" if isinstance(e, ConnectionRefusedError)
                        else "timeouts" if isinstance(e, TimeoutError) else "reset_in_flight")
                kinds[kind] += 1
                results.append((t, time.time(), None, None))
                time.sleep(0.001)

    th = threading.Thread(target=stream, daemon=True)
    th.start()
    poll_until(lambda: sum(1 for r in results if r[2] == active.pid) >= 20, 60, "20 answers from the active")
    kill_at = time.time()
    active.kill()
    active.wait(30)
    poll_until(lambda: any(r[2] == shadow.pid for r in results), 60, "an answer from the promoted shadow")
    stop.set()
    th.join(10)
    first_new = min(r[1] for r in results if r[2] == shadow.pid)
    lost = sum(1 for r in results if r[2] is None and r[0] >= kill_at - 0.5)
    prom = shadow.event("active", 30)
    pool = shadow.event("kv-pool", 30)
    print(f"  promoted engine's KV pool: {pool}", flush=True)
    figure("torch-engine failover: the promoted engine's KV pool (how, grant ms, decode graph captured again ms)",
           (pool.get("how"), pool.get("grant_ms"), pool.get("graph_recaptured_ms")), "")
    figure("torch-engine failover: SIGKILL -> first answer of the shadow", round((first_new - kill_at) * 1e3, 1),
           "ms", "published 4.6-6.2 s")
    figure("shadow's wake (weights check launched)", prom["wake_ms"], "ms")
    figure("shadow's wake -> port bound", prom["promote_ms"], "ms")
    figure("requests failed around the kill (retried)", lost, "")
    socket_kind = "own port" if OWN_PORT else "inherited socket"
    for kind, n in kinds.items():
        figure(f"{kind} through the kill ({socket_kind})", n, "", "0" if kind == "refused" and not OWN_PORT else None)
    if not OWN_PORT:
        assert kinds["refused"] == 0, f"refused connections with the pair socket: {kinds}"
    old = [r[3] for r in results if r[2] == active.pid]
    new = [r[3] for r in results if r[2] == shadow.pid]
    assert old and new and old[-1] == new[0], f"promoted engine answers differently: {old[-1]} vs {new[0]}"
    ready2 = notes.ready(30)
    assert int(ready2["MAINPID"]) == shadow.pid
    shadow.kill()
    shadow.wait(30)
    if listener is not None:
        listener.close()
    g.kill(signal.SIGTERM)
    assert g.wait(60) == 0


# --- through containerd ------------------------------------------------------
def failure_kind(e):
    """refused (nobody listened), timeouts, or reset_in_flight (connected,
    then lost with the engine that died; also a bad answer)."""
    if isinstance(e, ConnectionRefusedError):
        return "refused"
    if isinstance(e, TimeoutError):
        return "timeouts"
    return "reset_in_flight"


def stream_requests(port, results, stop, kinds=None, max_tokens=4):
    """A steady request stream: (sent, answered, engine slot, tokens) per
    request. The slot names the engine: inside its container each engine
    is pid 1, so the answer's pid does not. Failures are counted by kind in
    `kinds` (a dict) when given."""
    while not stop.is_set():
        t = time.time()
        try:
            body = request(port, timeout=2.0, max_tokens=max_tokens)
            results.append((t, time.time(), str(body["engine"]), body["choices"][0]["tokens"]))
        except (OSError, http.client.HTTPException, ValueError, KeyError) as e:
            if kinds is not None:
                kind = failure_kind(e)
                kinds[kind] = kinds.get(kind, 0) + 1
            results.append((t, time.time(), None, None))
            time.sleep(0.001)


def protected(rt, cid, failovers):
    st = rt.state(cid)
    return st if st and st["pair"]["protected"] and st["pair"]["failovers"] == failovers else None


def children(pid):
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(x) for x in f.read().split()]
    except OSError:
        return []


def json_events(proc):
    """A list that fills with the JSON objects `proc` prints (the engines
    of a pair both write to the task's stdout), from a thread of its own."""
    events = []

    def collect():
        for line in iter(proc.lines.get, None):
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if isinstance(obj, dict):
                events.append(obj)
    threading.Thread(target=collect, daemon=True).start()
    return events


class Probe:
    """One request sent at an instant (a kill, a hang) on a thread of its
    own, beside the stream: a new connection, which the promoted engine
    may answer before the request the stream had in flight (that one is
    in the fd store, and waits for the store's fetch). ``result()``: (sent,
    answered, engine slot, tokens) or an AssertionError."""

    def __init__(self, port, timeout=10.0):
        self.out = []

        def send():
            t = time.time()
            try:
                body = request(port, timeout=timeout)
                self.out.append((t, time.time(), str(body["engine"]), body["choices"][0]["tokens"]))
            except (OSError, http.client.HTTPException, ValueError, KeyError) as e:
                self.out.append((t, time.time(), None, repr(e)))
        self.th = threading.Thread(target=send, daemon=True)
        self.th.start()

    def result(self, timeout=15):
        self.th.join(timeout)
        if not self.out:
            raise AssertionError("the probe request was not answered in time")
        return self.out[0]


def takeovers(events):
    """What each promoted engine did with the fd store: per "resumed" line
    (connections, their request unread, answered again, continued), and
    the connections the engines gave up unanswered."""
    events = list(events)
    return ([(o.get("connections"), o.get("unread"), o.get("answered_again"), o.get("continued"))
             for o in events if o.get("event") == "resumed"],
            sum(1 for o in events if o.get("event") == "unanswered"))


def first_steps_figures(what, events):
    """Where a promoted engine's first answer went: its grant of the KV
    pool in parts (gmsd's answer, the mapping) and its first steps (from
    the grant: start, launch, wait for the device), per wake."""
    pools = [o for o in list(events) if o.get("event") == "kv-pool" and o.get("how") == "adopted"]
    figure(f"{what}: the promoted engines' grant of the KV pool in parts (total, gmsd's answer, map), per wake",
           [(o.get("grant_ms"), *(round(v, 2) for v in (o.get("grant_parts_ms") or {}).values()))
            for o in pools], "ms")
    figure(f"{what}: the KV pool mapped when the promoted engine's grant returned, per wake",
           [o.get("mapped_at_grant", 0) >> 20 for o in pools], "MiB")
    figure(f"{what}: the whole KV pool mapped, ms after the grant, per grant (the pair's first engine's too)",
           [e.get("ms") for e in list(events) if e.get("event") == "kv-pool-mapped"], "ms")
    steps = [o["steps"] for o in list(events) if o.get("event") == "first-steps" and o.get("how") == "adopted"]
    figure(f"{what}: the promoted engines' first steps (launches, ms from the grant, launch ms, device wait ms), "
           "per wake", [[(st["launches"], st["at_ms"], st["launch_ms"], st["sync_ms"]) for st in w[:5]]
                        for w in steps], "")


def first_answer_parts(events):
    """Per promotion, the promoted engine's path from the lock to its first
    answer in ms from the lock: READY=1 sent, the fd store's fetch returned
    (and the attempts it took), the first answered connection taken
    (new, or resumed from the store), the time spent awaiting the weights
    check's verdict, the first answer sent. An engine that logs no parts
    (an earlier engine.py, --engine) gives what its other lines say."""
    events = list(events)
    out = []
    for e in events:
        if e.get("event") != "first-answer":
            continue
        if "ready_ms" in e:
            out.append({"ready": e.get("ready_ms"), "fetched": e.get("fetched_ms"),
                        "attempts": e.get("fetch_attempts"), "conn": e.get("first_conn_ms"),
                        "first": e.get("first_conn"), "verdict_wait": e.get("verdict_wait_ms"),
                        "answer": e.get("ms")})
            continue
        same = [o for o in events if str(o.get("engine")) == str(e.get("engine")) and o.get("t", 0) <= e["t"]]
        act = [o for o in same if o.get("event") == "active"]
        if not act:
            continue
        since = act[-1]["t"]
        fetched = [o for o in same if o.get("event") == "fdstore-fetched" and o["t"] >= since]
        failed = [o for o in same if o.get("event") == "fdstore-fetch-failed" and o["t"] >= since]
        ready = act[-1].get("promote_ms")
        out.append({"ready": ready,
                    "fetched": round(ready + fetched[-1]["ms"], 1) if fetched and ready is not None else None,
                    "attempts": len(failed) + len(fetched), "answer": e.get("ms")})
    return out


def containerd_pair(tp):
    """A TP=tp torch-engine pair through `ctr run --runtime io.containerd.shadow.v1`."""
    rt = runtime()
    baseline = gpu_used_mib()
    cid, port = f"tp{tp}", 19000 + tp * 100 + os.getpid() % 100
    layers, kv = (2, 2) if QUICK else (8, 8)
    env = ctr_pair.engine_env(port, layers, kv, BIN)
    env["ENGINE_TP"] = str(tp)
    args = rt.run_args(ctr_pair.SHIM_RUNTIME, cid, env, [sys.executable, ENGINE],
                       extra=["--runtime-config-path", rt.shim_config, "--annotation", "shadow.dev/pair=true",
                              # The pair's listening socket (LISTEN_FDS): the promoted engine
                              # accepts at once, no bind, no refused connection in the gap.
                              "--annotation", f"shadow.dev/listen=tcp:127.0.0.1:{port}"])
    run = Proc(f"ctr-run-{cid}", args, stdin=False)
    # The engines' JSON lines (both write to the task's stdout).
    run_events = json_events(run)

    def up(failovers, cold=0):
        def check():
            if run.p.poll() is not None:
                raise AssertionError(f"the pair ended (ctr run rc {run.p.poll()})")
            st = protected(rt, cid, failovers)
            return st if st and st["pair"]["cold_restarts"] == cold else None
        return check
    try:
        st = poll_until(up(0), 180, "pair protected (active + parked shadow)")
    except AssertionError:
        raise AssertionError(f"{run.stderr_tail()}\ncontainerd: {rt.log_tail()}") from None
    gms = st.get("gms_daemons") or []
    assert len(gms) == tp and all(g["device"].startswith("GPU-") and g["backend"] == "cuda" for g in gms), gms
    reference = request(port)["choices"][0]["tokens"]
    # The engine's own floor: a one-token request with nobody dying.
    one = []
    for _ in range(21):
        t = time.perf_counter()
        request(port, max_tokens=1)
        one.append((time.perf_counter() - t) * 1e3)
    figure(f"TP={tp} through containerd: one request of 1 token with no failover, p50",
           round(sorted(one)[len(one) // 2], 1), "ms")
    stop, results, kinds = threading.Event(), [], {"refused": 0, "reset_in_flight": 0, "timeouts": 0}
    th = threading.Thread(target=stream_requests, args=(port, results, stop, kinds), daemon=True)
    th.start()
    latencies, parked_mib, to_lock = [], [], []
    # Per kill: the answer to the stream's request in flight at the kill
    # (resumed from the fd store) and to the probe sent right after it.
    in_flight, sent_after = [], []

    def kill_and_time(victim, slot, what):
        """SIGKILL `victim` (a pid of the active group of `slot`): ms to the other slot's first correct answer."""
        poll_until(lambda: sum(1 for r in list(results) if r[2] == str(slot)) >= 10, 60,
                   "10 answers from the active")
        kill_at = time.time()
        os.kill(victim, signal.SIGKILL)
        probe = Probe(port)
        first = poll_until(lambda: next((r for r in list(results)
                                         if r[2] == str(1 - slot) and r[1] > kill_at), None),
                           60, f"an answer from the promoted shadow after {what}")
        assert first[3] == reference, f"{what}: the promoted engine answers {first[3]}, not {reference}"
        new = probe.result()
        assert new[2] == str(1 - slot) and new[3] == reference, f"{what}: the probe request got {new}"
        in_flight.append(round((first[1] - kill_at) * 1e3, 1))
        sent_after.append(round((new[1] - kill_at) * 1e3, 1))
        first = min(first, new, key=lambda r: r[1])
        # When the promoted engine's flock returned (its "active" line): the
        # part of the figure that is the dying process's exit.
        # The line travels through ctr's stdout: it may trail the answer.
        try:
            woke = poll_until(lambda: [o["woke_at"] for o in list(run_events) if o.get("event") == "active"
                                       and str(o.get("engine")) == str(1 - slot)
                                       and o.get("woke_at", 0) > kill_at], 5, "the promoted engine's active line")
            to_lock.append(round((min(woke) - kill_at) * 1e3, 1))
        except AssertionError:
            to_lock.append(None)
        return round((first[1] - kill_at) * 1e3, 1)

    failovers = 0
    try:
        for rnd in range(3):
            st = protected(rt, cid, failovers)
            slot = st["pair"]["active"]
            active, shadow = st["pids"][slot], st["pids"][1 - slot]
            parked_mib.append([app_mib().get(p) for p in [shadow] + children(shadow)])
            latencies.append(kill_and_time(active, slot, f"SIGKILL of the active, round {rnd}"))
            failovers += 1
            task = poll_until(lambda: (lambda t: t if t and t[0] == shadow else None)(rt.task(cid)), 10,
                              f"ctr task ls shows the promoted engine's pid {shadow}: {rt.task(cid)}")
            assert task[1] == "RUNNING", task
            st = poll_until(up(failovers), 120, f"round {rnd}: killed slot back, parked")
            assert st["pid"] == shadow and st["pair"]["active"] == 1 - slot, "State's pid follows the active"
            print(f"  round {rnd}: SIGKILL -> first correct answer {latencies[-1]} ms", flush=True)
        if tp > 1:
            # A rank (not the main process) of the active: the group ends, the shadow serves.
            st = protected(rt, cid, failovers)
            slot = st["pair"]["active"]
            ranks = children(st["pids"][slot])
            assert len(ranks) == tp - 1, f"the active's ranks: {ranks}"
            rank_ms = kill_and_time(ranks[-1], slot, "SIGKILL of a rank of the active")
            failovers += 1
            st = poll_until(up(failovers), 120, "the group whose rank died back, parked")
            figure(f"TP={tp} through containerd: SIGKILL of one rank of the active -> first correct answer",
                   rank_ms, "ms", "<= 200 ms")
            # A rank of the shadow: only the shadow is started again.
            slot = st["pair"]["active"]
            gen = st["pair"]["slots"][1 - slot]["generation"]
            os.kill(children(st["pids"][1 - slot])[-1], signal.SIGKILL)
            st = poll_until(lambda: (lambda s: s if s and s["pair"]["slots"][1 - slot]["generation"] > gen
                                     and s["pair"]["protected"] else None)(rt.state(cid)), 120,
                            "the shadow group respawned")
            assert st["pair"]["active"] == slot and st["pair"]["failovers"] == failovers, "the active was touched"
            # One GPU's gmsd: that GPU's weights are gone, the pair restarts cold.
            victim = st["gms_daemons"][-1]
            os.kill(victim["pid"], signal.SIGKILL)
            st = poll_until(up(failovers, cold=1), 240, "a cold restart after a gmsd died")
            assert st["pair"]["last_cold_restart"] == {"cause": "gms_died", "device": victim["device"]}, st["pair"]
            assert request(port)["choices"][0]["tokens"] == reference
    finally:
        stop.set()
        th.join(10)
    wrong = [r for r in results if r[3] is not None and r[3] != reference]
    assert not wrong, f"{len(wrong)} answers differ from the reference"
    p50 = sorted(latencies)[len(latencies) // 2]
    STATE[f"shadow_ms_tp{tp}"] = p50
    # What one request costs when nobody dies: the floor under the figure above.
    steady = sorted(r[1] - r[0] for r in results if r[3] is not None)
    steady_ms = round(steady[len(steady) // 2] * 1e3, 1)
    figure(f"TP={tp} through containerd: one request (4 tokens) with no failover, p50", steady_ms, "ms")
    figure(f"TP={tp} through containerd: SIGKILL -> first correct answer, p50, less one undisturbed request",
           round(p50 - steady_ms, 1), "ms", "<= 5 ms" if tp == 1 else None)
    wakes = [o for o in list(run_events) if o.get("event") == "active"]
    figure(f"TP={tp} through containerd: engines' wake (lock -> weights check launched, ready to accept), per wake",
           [(o.get("wake_ms"), o.get("promote_ms")) for o in wakes], "ms")
    checks = [o for o in list(run_events) if o.get("event") == "weights-verified" and o.get("when") == "promoted"]
    figure(f"TP={tp} through containerd: the promoted engine's weights check (GPU digest of "
           f"{(checks[0]['bytes'] >> 20) if checks else '?'} MiB, overlapping the first request), per wake",
           [o.get("ms") for o in checks], "ms")
    figure(f"TP={tp} through containerd: the promoted engine's weights check in parts (launched, verdict "
           f"{'at the first answer' if tp == 1 else 'awaited'}), per wake",
           [(o.get("launch_ms"), o.get("wait_ms")) for o in checks], "ms")
    figure(f"TP={tp} through containerd: the promoted engine's lock -> its first answer sent, per wake",
           [o.get("ms") for o in list(run_events) if o.get("event") == "first-answer"], "ms")
    figure(f"TP={tp} through containerd: the promoted engine's lock -> first answer in parts (ms from the lock), "
           "per wake", first_answer_parts(run_events), "")
    figure(f"TP={tp} through containerd: connections the promoted engines resumed (connections, unread, answered "
           "again, continued), and those given up unanswered", takeovers(run_events), "")
    if tp == 1:
        figure("TP=1 through containerd: the KV pool as each engine took it (how, grant ms, graphs captured "
               "again ms)", [(o.get("how"), o.get("grant_ms"), o.get("graph_recaptured_ms"))
                             for o in list(run_events) if o.get("event") == "kv-pool"], "")
        first_steps_figures("TP=1 through containerd", run_events)
    else:
        figure(f"TP={tp} through containerd: the promoted engine's KV growth (from its first answer) to all of it "
               "backed, per wake",
               [o.get("ms") for o in list(run_events) if o.get("event") == "kv-backed"], "ms")
    target = "<= 25 ms" if tp == 1 else "<= 100 ms"
    figure(f"TP={tp} through containerd: SIGKILL of the active -> first correct answer, per round",
           latencies, "ms")
    figure(f"TP={tp} through containerd: SIGKILL -> the answer to the stream's request in flight at the kill "
           "(resumed from the fd store), per round", in_flight, "ms")
    figure(f"TP={tp} through containerd: SIGKILL -> the answer to a request sent right after the kill "
           "(a new connection), per round", sent_after, "ms")
    figure(f"TP={tp} through containerd: SIGKILL -> first correct answer, p50 of {len(latencies)}", p50, "ms", target)
    figure(f"TP={tp} through containerd: SIGKILL -> the promoted engine holds the lock, per kill", to_lock, "ms")
    figure(f"TP={tp} through containerd: parked shadow device memory per process (nvidia-smi), per round",
           parked_mib, "MiB", "<= 800 MiB per GPU")
    figure(f"TP={tp} through containerd: memory torch holds in a parked engine (its allocator, per park)",
           [o.get("torch_reserved_mib") for o in list(run_events) if o.get("event") == "parked"], "MiB")
    figure(f"TP={tp} through containerd: weights held by the gmsds",
           [g.get("resident_bytes", 0) >> 20 for g in gms], "MiB")
    figure(f"TP={tp} through containerd: requests failed around the kills (retried)",
           sum(1 for r in results if r[2] is None), "")
    # The pair owns the listening socket (shadow.dev/listen): a connection
    # made while nobody is active waits in its backlog, never refused.
    for kind, n in kinds.items():
        figure(f"TP={tp} through containerd: {kind} through the kills", n, "",
               "0" if kind == "refused" else None)
    assert kinds["refused"] == 0, f"refused connections with the pair's socket: {kinds}"
    # The same kills under a stream of one-token requests: what is left of
    # the figure when the engine's own request is short (prefill, 1 step).
    ref1 = request(port, max_tokens=1)["choices"][0]["tokens"]
    stop1, results1 = threading.Event(), []
    th1 = threading.Thread(target=stream_requests, args=(port, results1, stop1, None, 1), daemon=True)
    th1.start()
    one_token = []
    try:
        for rnd in range(3):
            st = protected(rt, cid, failovers)
            slot = st["pair"]["active"]
            poll_until(lambda: sum(1 for r in list(results1) if r[2] == str(slot)) >= 10, 60, "10 answers")
            kill_at = time.time()
            os.kill(st["pids"][slot], signal.SIGKILL)
            first = poll_until(lambda: next((r for r in list(results1)
                                             if r[2] == str(1 - slot) and r[1] > kill_at), None),
                               60, "an answer from the promoted shadow (one-token stream)")
            assert first[3] == ref1, f"one-token round {rnd}: {first[3]}, not {ref1}"
            one_token.append(round((first[1] - kill_at) * 1e3, 1))
            failovers += 1
            poll_until(up(failovers), 120, f"one-token round {rnd}: killed slot back, parked")
    finally:
        stop1.set()
        th1.join(10)
    assert not [r for r in results1 if r[3] is not None and r[3] != ref1], "wrong one-token answers"
    figure(f"TP={tp} through containerd: SIGKILL -> first correct answer, requests of 1 token, per round",
           one_token, "ms")
    figure(f"TP={tp} through containerd: SIGKILL -> first correct answer, requests of 1 token, p50 of 3",
           sorted(one_token)[1], "ms", target)
    weights_changed_under_the_pair(rt, cid, port, reference, run_events, tp)

    rt.ctr("task", "kill", "--signal", "SIGKILL", cid)
    assert run.wait(60) != 0
    markers = [rt.address, rt.state_dir, ENGINE]
    left = poll_until(lambda: (lambda p: None if p else "none")(ctr_pair.our_processes(markers)), 30,
                      f"no engine, gmsd or shim left: {ctr_pair.our_processes(markers)}")
    assert left == "none"
    assert not ctr_pair.mounts_under(rt.base), ctr_pair.mounts_under(rt.base)
    left = glob.glob(os.path.join(glob.escape(rt.state_dir), "*", ctr_pair.NS, cid))
    assert not left, f"pair dir left: {left}"
    assert rt.ctr("containers", "ls", "-q").stdout.strip() == "", "container left"
    after = memory_back(baseline)
    figure(f"TP={tp} through containerd: device memory before / after the pair", f"{baseline} / {after}",
           "MiB")


def weights_changed_under_the_pair(rt, cid, port, reference, run_events, tp):
    """The CUDA attack of docs/security.md on a live pair: a process holding
    the handle makes its mapping read-write and negates the final norm, so
    the active engine answers wrongly. Then SIGKILL of the active: the
    promoted engine checks the digest before its first answer, exits 65, and the pair
    restarts cold (weights generated again), naming the cause."""
    st = rt.state(cid)
    slot, cold = st["pair"]["active"], st["pair"]["cold_restarts"]
    g0 = st["gms_daemons"][0]
    bad = Proc("scribbler", [sys.executable, WORKER, "scribble", "--tensor", "norm"],
               env={"GMS_SOCKET_DIR": os.path.dirname(g0["socket"])})
    ev = bad.expect(lambda o: isinstance(o, dict) and o.get("event") in ("scribbled", "scribble_refused"), 120,
                    "scribble outcome")
    bad.wait(30)
    if ev["event"] == "scribble_refused":
        figure(f"TP={tp} through containerd: cuMemSetAccess(READWRITE) on the pair's weights",
               f"refused (rc {ev['rc']})", "")
        assert request(port)["choices"][0]["tokens"] == reference
        return
    damaged = request(port)["choices"][0]["tokens"]
    assert damaged != reference, "the negated norm changed no answer"
    kill_at = time.time()
    os.kill(st["pids"][slot], signal.SIGKILL)

    def mended():
        s = rt.state(cid)
        if not (s and s["pair"]["cold_restarts"] == cold + 1 and s["pair"]["protected"]):
            return None
        try:
            return s, request(port, timeout=2.0)["choices"][0]["tokens"]
        except (OSError, http.client.HTTPException, ValueError, KeyError):
            return None
    st, tokens = poll_until(mended, 240, "a cold restart after the promoted engine found the weights changed")
    mended_ms = round((time.time() - kill_at) * 1e3, 1)
    assert tokens == reference, f"after the cold restart: {tokens}, not {reference}"
    assert st["pair"]["last_cold_restart"] == {"cause": "weights_corrupt", "slot": 1 - slot}, st["pair"]
    assert st["pair"]["weights_corrupt"] == 1, st["pair"]
    found = [o for o in list(run_events) if o.get("event") == "weights-corrupt"]
    assert found and found[0]["when"] == "promoted", found
    print(f"  the promoted engine: {found[0]['error']}", flush=True)
    figure(f"TP={tp} through containerd: weights changed under the pair -> SIGKILL of the active -> "
           "cold restart -> first correct answer", mended_ms, "ms")


def test_containerd_pair_hang():
    """A hung active engine through containerd (issue 22): the torch engine
    pings its watchdog (shadow.dev/watchdog=100ms) from its serving loop.
    SIGSTOP of the active, then a GPU kernel that never finishes (the
    engine's SHADOW_TEST_HANG request): each -> the pair kills it, the
    shadow takes the lock, wakes and serves. Figures: the total and its
    parts (detected, killed, lock taken, wake, first answer)."""
    rt = runtime()
    cid, port = "hang", 19500 + os.getpid() % 100
    layers, kv = (2, 2) if QUICK else (8, 8)
    env = ctr_pair.engine_env(port, layers, kv, BIN)
    env["SHADOW_TEST_HANG"] = "1"
    args = rt.run_args(ctr_pair.SHIM_RUNTIME, cid, env, [sys.executable, ENGINE],
                       extra=["--runtime-config-path", rt.shim_config, "--annotation", "shadow.dev/pair=true",
                              "--annotation", f"shadow.dev/listen=tcp:127.0.0.1:{port}",
                              "--annotation", "shadow.dev/watchdog=100ms"])
    run = Proc(f"ctr-run-{cid}", args, stdin=False)
    run_events = json_events(run)

    def up(failovers):
        def check():
            if run.p.poll() is not None:
                raise AssertionError(f"the pair ended (ctr run rc {run.p.poll()})")
            return protected(rt, cid, failovers)
        return check
    try:
        poll_until(up(0), 180, "pair protected (active + parked shadow)")
    except AssertionError:
        raise AssertionError(f"{run.stderr_tail()}\nengines: {list(run_events)[-12:]}\n"
                             f"state: {rt.state(cid)}\ncontainerd: {rt.log_tail()}") from None
    reference = request(port)["choices"][0]["tokens"]
    stop, results = threading.Event(), []
    th = threading.Thread(target=stream_requests, args=(port, results, stop), daemon=True)
    th.start()
    rows, failovers, probes = [], 0, []
    try:
        time.sleep(1.0)
        st = rt.state(cid)
        assert st["pair"]["hangs"]["watchdog"] == 0, f"a healthy engine was ended: {st['pair']}"
        for how in ("sigstop", "sigstop", "gpu-kernel", "gpu-kernel"):
            st = protected(rt, cid, failovers)
            slot = st["pair"]["active"]
            victim = st["pids"][slot]
            poll_until(lambda: sum(1 for r in list(results) if r[2] == str(slot)) >= 5, 60, "answers")
            at = time.time()
            if how == "sigstop":
                os.kill(victim, signal.SIGSTOP)
            else:
                c = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
                c.request("POST", "/test/hang", "{}", {"Content-Type": "application/json"})
                c.getresponse().read()
                c.close()
                at = time.time()
            probe = Probe(port, timeout=30.0)
            first = poll_until(lambda: next((r for r in list(results)
                                             if r[2] == str(1 - slot) and r[1] > at), None),
                               60, f"an answer from the shadow after a hang ({how})")
            assert first[3] == reference, f"{how}: {first[3]} is not {reference}"
            new = probe.result(40)
            assert new[2] == str(1 - slot) and new[3] == reference, f"{how}: the probe request got {new}"
            probes.append((round((first[1] - at) * 1e3, 1), round((new[1] - at) * 1e3, 1)))
            first = min(first, new, key=lambda r: r[1])
            failovers += 1
            st = poll_until(up(failovers), 120, f"{how}: the hung slot back, parked")
            rec = st["promotions"][-1]
            p = rec
            assert p["class"] == "hung" and p["hang"]["cause"] == "watchdog", p
            detected, killed = p["hang_detected_unix_us"] / 1e6, p["hang_killed_unix_us"] / 1e6
            ready = p["ready_unix_us"] / 1e6
            woke = [o["woke_at"] for o in list(run_events) if o.get("event") == "active"
                    and str(o.get("engine")) == str(1 - slot) and o.get("woke_at", 0) > at]
            lock = min(woke) if woke else None
            ms = lambda a, b: None if a is None or b is None else round((b - a) * 1e3, 1)
            rows.append({"how": how, "total": ms(at, first[1]), "detected": ms(at, detected),
                         "killed": ms(detected, killed), "lock": ms(killed, lock),
                         "wake": ms(lock, ready), "answer": ms(ready, first[1])})
            print(f"  {how}: {rows[-1]}", flush=True)
            assert not os.path.exists(f"/proc/{victim}"), f"the hung engine {victim} is still there"
    finally:
        stop.set()
        th.join(10)
    for how in ("sigstop", "gpu-kernel"):
        figure(f"hang ({how}) of the active, watchdog 100 ms, through containerd: hang -> first correct "
               "answer, and its parts (detected, killed, lock taken, wake to READY, READY to answer), per round",
               [r for r in rows if r["how"] == how], "ms", "detection bound (100 ms) + wake")
    figure("hang, watchdog 100 ms: first correct answer after the detection (hang -> answer less hang -> detected), "
           "per round", [None if r["total"] is None or r["detected"] is None else round(r["total"] - r["detected"], 1)
                         for r in rows], "ms", "<= 20 ms")
    figure("hang: hang -> the answer to the stream's request in flight (resumed from the fd store, or from the "
           "backlog) / to a request sent at the hang (new connection), per round", probes, "ms")
    figure("hang: connections the promoted engines resumed (connections, unread, answered again, continued), "
           "and those given up unanswered", takeovers(run_events), "")
    figure("hang: the promoted engine's lock -> first answer in parts (ms from the lock), per wake",
           first_answer_parts(run_events), "")
    rt.ctr("task", "kill", "--signal", "SIGKILL", cid)
    assert run.wait(60) != 0
    markers = [rt.address, rt.state_dir, ENGINE]
    poll_until(lambda: (lambda p: None if p else "none")(ctr_pair.our_processes(markers)), 30,
               f"no engine, gmsd or shim left: {ctr_pair.our_processes(markers)}")


def test_containerd_pair_tp1():
    containerd_pair(1)


# A prefix shared by requests (about 1,000 tokens: one token per byte).
SHARED_PREFIX = ("The pair's KV pool outlives the engine that wrote it, and its prefix cache with it. " * 12)[:1000]


# Requests per median of the shared prefix's TTFT (before, after a kill).
PREFIX_SAMPLES = 7


def first_token_ms(port, prompt, timeout=30.0):
    """A streamed completion of one token: ms from the request's send to
    its first event (its TTFT), and the text."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        body = json.dumps({"prompt": prompt, "max_tokens": 1, "stream": True}).encode()
        t0 = time.perf_counter()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: engine\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        got, first = b"", None
        while True:
            b = s.recv(65536)
            if not b:
                break
            got += b
            if first is None and b"data: " in got:
                first = (time.perf_counter() - t0) * 1e3
    finally:
        s.close()
    events = got.partition(b"\r\n\r\n")[2]
    texts = [json.loads(e[6:])["choices"][0]["text"] for e in events.split(b"\n\n")
             if e.startswith(b"data: {")]
    return first, "".join(texts)


def test_containerd_pair_kv_fills_the_gpu():
    """A KV pool sized to the GPU, as engines are deployed: gmsd holds it
    once for the pair, so the promoted shadow maps the very pages the dead
    engine used, with what it left in them, and waits for none of its
    memory. Three kills: each first answer checked and timed, the parked
    shadow's device memory (the pool is in no engine's), and the TTFT of
    requests that share a 1,000-token prefix before and right after each
    failover (the prefix cache is carried)."""
    rt = runtime()
    total = int(smi("--query-gpu=memory.total", "-i", "0").splitlines()[0])
    layers = 2 if QUICK else 8
    weights_mib = 250 + layers * 384  # embed + 12·4096² bf16 per layer (engine.py)
    # Weights, two engines' contexts (~800 MiB each) and 3 GiB for the
    # active engine's work (and the dying one's): the rest is the pool.
    kv_gib = (total - gpu_used_mib() - weights_mib - 2 * 800 - 3072) // 1024
    assert 2 * kv_gib * 1024 > total - weights_mib, (total, kv_gib)
    cid, port = "kvfull", 19800 + os.getpid() % 100
    env = ctr_pair.engine_env(port, layers, kv_gib, BIN)
    args = rt.run_args(ctr_pair.SHIM_RUNTIME, cid, env, [sys.executable, ENGINE],
                       extra=["--runtime-config-path", rt.shim_config, "--annotation", "shadow.dev/pair=true",
                              "--annotation", f"shadow.dev/listen=tcp:127.0.0.1:{port}"])
    run = Proc(f"ctr-run-{cid}", args, stdin=False)
    events = json_events(run)
    try:
        st = poll_until(lambda: protected(rt, cid, 0), 240, "pair protected")
    except AssertionError:
        raise AssertionError(f"{run.stderr_tail()}\ncontainerd: {rt.log_tail()}") from None
    reference = request(port)["choices"][0]["tokens"]
    undisturbed = []
    for _ in range(11):
        t = time.perf_counter()
        request(port)
        undisturbed.append((time.perf_counter() - t) * 1e3)
    cold_ms, _ = first_token_ms(port, SHARED_PREFIX + " question 0")
    first, parked, warm, after = [], [], [], []
    for rnd in range(3):
        st = poll_until(lambda: protected(rt, cid, rnd), 240, f"round {rnd}: pair protected")
        slot = st["pair"]["active"]
        shadow = st["pids"][1 - slot]
        parked.append(app_mib().get(shadow))
        generation = st["pair"]["slots"][1 - slot]["generation"]
        # The prefix warm: requests that share it, before the kill.
        warm.append(sorted(first_token_ms(port, SHARED_PREFIX + f" before {rnd}.{k}")[0]
                           for k in range(PREFIX_SAMPLES))[PREFIX_SAMPLES // 2])
        kill_at = time.time()
        os.kill(st["pids"][slot], signal.SIGKILL)

        def promoted(prompt="hello shadow", max_tokens=4):
            try:
                body = request(port, prompt=prompt, max_tokens=max_tokens, timeout=5.0)
            except (OSError, http.client.HTTPException, ValueError):
                return None
            return body if str(body["engine"]) == str(1 - slot) else None
        body = poll_until(promoted, 60, "the shadow serves")
        first.append(round((time.time() - kill_at) * 1e3, 1))
        assert body["choices"][0]["tokens"] == reference, f"round {rnd}: {body}"
        # Right after the failover: requests that share the prefix.
        got = [first_token_ms(port, SHARED_PREFIX + f" after {rnd}.{k}") for k in range(PREFIX_SAMPLES)]
        after.append(sorted(ms for ms, _ in got)[PREFIX_SAMPLES // 2])
        st = poll_until(lambda: protected(rt, cid, rnd + 1), 240, f"round {rnd}: the killed slot back, parked")
        assert st["pair"]["slots"][1 - slot]["generation"] == generation, "the promoted engine died and came back"
        print(f"  round {rnd}: SIGKILL -> first correct answer {first[-1]} ms; prefix TTFT before {warm[-1]:.1f} ms, "
              f"after {after[-1]:.1f} ms", flush=True)
    pools = [o for o in list(events) if o.get("event") == "kv-pool"]
    assert pools and pools[0]["how"] == "new" and all(p["how"] == "adopted" for p in pools[1:]), pools
    assert len({p["addr"] for p in pools}) == 1, f"the pool moved: {pools}"
    figure(f"KV pool of {kv_gib} GiB on a {total // 1024} GiB GPU: SIGKILL -> first correct answer, per kill",
           first, "ms")
    und = round(sorted(undisturbed)[5], 1)
    figure(f"KV pool of {kv_gib} GiB: SIGKILL -> first correct answer, p50 of 3", sorted(first)[1], "ms",
           "the small-KV figure (test_containerd_pair_tp1)")
    figure("KV pool fills the GPU: one request (4 tokens) with no failover, p50", und, "ms")
    figure("KV pool fills the GPU: SIGKILL -> first correct answer, p50, less one undisturbed request",
           round(sorted(first)[1] - und, 1), "ms", "<= 5 ms")
    figure("KV pool fills the GPU: parked shadow device memory (nvidia-smi), per kill", parked, "MiB",
           "unchanged, <= 800 MiB")
    figure("KV pool fills the GPU: the promoted engines' grant of the pool", [p["grant_ms"] for p in pools[1:]], "ms")
    tables = [(o.get("fd_table"), o.get("how")) for o in list(events) if o.get("event") in ("parked", "kv-pool")]
    figure("KV pool fills the GPU: descriptor table size at each park and grant, in order", tables, "",
           "unchanged from park to grant")
    first_steps_figures("KV pool fills the GPU", events)
    figure("KV pool fills the GPU: the promoted engines' graphs captured again at the grant",
           [p["graph_recaptured_ms"] for p in pools[1:]], "ms", "none (null)")
    figure("KV pool fills the GPU: lock -> first answer sent, per wake",
           [o.get("ms") for o in list(events) if o.get("event") == "first-answer"], "ms")
    figure("prefix of 1,000 tokens: TTFT cold (first request)", round(cold_ms, 1), "ms")
    figure(f"prefix of 1,000 tokens: TTFT before each failover (warm, p50 of {PREFIX_SAMPLES})",
           [round(x, 1) for x in warm], "ms")
    figure(f"prefix of 1,000 tokens: TTFT right after each failover (p50 of {PREFIX_SAMPLES})",
           [round(x, 1) for x in after], "ms", "within 10 % of before")
    figure("prefix of 1,000 tokens: after / before, worst of 3 failovers",
           round(max(a / w for a, w in zip(after, warm)), 3), "", "<= 1.10")
    assert None not in parked and max(parked) - min(parked) <= 32, f"the parked shadow's memory changed: {parked}"
    rt.ctr("task", "kill", "--signal", "SIGKILL", cid)
    assert run.wait(60) != 0
    left = poll_until(lambda: (lambda p: None if p else "none")(
        ctr_pair.our_processes([rt.address, rt.state_dir, ENGINE])), 30, "no engine, gmsd or shim left")
    assert left == "none"


def shadows_pair(rt, cid, port, shadows, accept="engine"):
    """A TP=1 torch-engine pair with `shadows` shadows through containerd,
    its connections accepted by each engine or by the runtime
    (`shadow.dev/accept`); returns (ctr run, its events)."""
    layers, kv = (2, 2) if QUICK else (8, 8)
    env = ctr_pair.engine_env(port, layers, kv, BIN)
    args = rt.run_args(ctr_pair.SHIM_RUNTIME, cid, env, [sys.executable, ENGINE],
                       extra=["--runtime-config-path", rt.shim_config, "--annotation", "shadow.dev/pair=true",
                              "--annotation", f"shadow.dev/shadows={shadows}",
                              "--annotation", f"shadow.dev/listen=tcp:127.0.0.1:{port}",
                              "--annotation", f"shadow.dev/accept={accept}"])
    run = Proc(f"ctr-run-{cid}", args, stdin=False)
    return run, json_events(run)


def all_parked(rt, cid):
    st = rt.state(cid)
    ok = (st and st["pair"]["protected"] and st["pair"]["shadows_parked"] == st["pair"]["shadows"]
          and all(p is not None for p in st["pids"]))
    return st if ok else None


def kill_burst(rt, cid, results, kills, reference):
    """SIGKILLs whoever serves `kills` times, 20 ms apart (or as soon as a
    new engine serves, if later): per kill, ms to the first correct answer
    to a request sent after it."""
    killed, times = set(), []
    last = 0.0
    for k in range(kills):
        def serving():
            st = rt.state(cid)
            a = st["pair"]["active"] if st else None
            if a is None or st["pair"]["slots"][a]["state"] != "active" or st["pids"][a] in killed:
                return None
            return st["pids"][a]
        pid = poll_until(serving, 30, f"kill {k}: an engine serves")
        time.sleep(max(0.0, last + 0.020 - time.time()))
        last = time.time()
        os.kill(pid, signal.SIGKILL)
        killed.add(pid)
        times.append(last)
    out = []
    for at in times:
        # The first answer to a request sent after the kill: a live engine's
        # (the killed one answers nothing sent after its death). Slots do
        # not name engines here: a respawn serves in its slot again.
        first = poll_until(lambda: next((r for r in list(results) if r[2] is not None and r[0] > at), None),
                           60, "an answer after the kill")
        assert first[3] == reference, f"the promoted engine answers {first[3]}, not {reference}"
        out.append(round((first[1] - at) * 1e3, 1))
    return out


def test_containerd_pair_two_shadows():
    """shadow.dev/shadows=2 with the torch engine: three engines, two of
    them parked; two SIGKILLs of whoever serves 20 ms apart are each
    recovered by a parked shadow, against a pair of one shadow in the same
    run, whose second kill waits for a respawn to park. Every answer
    checked; each parked shadow's device memory measured."""
    rt = runtime()
    baseline = gpu_used_mib()
    figures = {}
    for shadows in (2, 1):
        # Short ids: the test's state dir is long, and a GPU pair's socket
        # paths must fit sun_path.
        cid, port = f"n{shadows}", 19600 + shadows * 10 + os.getpid() % 10
        run, events = shadows_pair(rt, cid, port, shadows)

        def parked_or_ended():
            if run.p.poll() is not None:
                raise AssertionError(f"the pair ended (ctr run rc {run.p.poll()})")
            return all_parked(rt, cid)
        try:
            st = poll_until(parked_or_ended, 240, f"shadows={shadows}: every shadow parked")
        except AssertionError:
            raise AssertionError(f"{run.stderr_tail()}\ncontainerd: {rt.log_tail()}") from None
        assert len(st["pids"]) == shadows + 1 and st["pair"]["shadows"] == shadows, st["pair"]
        active = st["pair"]["active"]
        apps = app_mib()
        parked = [apps.get(p) for i, p in enumerate(st["pids"]) if i != active]
        reference = request(port)["choices"][0]["tokens"]
        stop, results = threading.Event(), []
        th = threading.Thread(target=stream_requests, args=(port, results, stop), daemon=True)
        th.start()
        bursts = []
        try:
            for b in range(2 if shadows > 1 else 1):
                poll_until(lambda: sum(1 for r in list(results) if r[2] is not None) >= 10, 60, "answers")
                bursts.append(kill_burst(rt, cid, results, 2, reference))
                print(f"  shadows={shadows} burst {b}: kill -> first correct answer {bursts[-1]} ms", flush=True)
                poll_until(lambda: all_parked(rt, cid), 240, f"shadows={shadows}: every shadow parked again")
        finally:
            stop.set()
            th.join(10)
        wrong = [r for r in results if r[3] is not None and r[3] != reference]
        assert not wrong, f"{len(wrong)} wrong answers"
        figures[shadows] = (bursts, parked)
        print(f"  shadows={shadows}: parked shadows' device memory {parked} MiB", flush=True)
        rt.ctr("task", "kill", "--signal", "SIGKILL", cid)
        assert run.wait(60) != 0
        left = poll_until(lambda: (lambda p: None if p else "none")(
            ctr_pair.our_processes([rt.address, rt.state_dir, ENGINE])), 30, "no engine, gmsd or shim left")
        assert left == "none"
    for shadows, (bursts, parked) in figures.items():
        figure(f"shadows={shadows}, torch engine through containerd: two SIGKILLs of whoever serves 20 ms apart "
               "-> first correct answer after each, per burst", bursts, "ms")
        figure(f"shadows={shadows}: device memory of each parked shadow (nvidia-smi)", parked, "MiB")
    figure("shadows pairs: device memory before / after", f"{baseline} / {memory_back(baseline)}", "MiB")


def test_containerd_runc_cold_restart():
    """The same engine under runc-v2: SIGKILL, then a cold restart (fresh gmsd, weights loaded again)."""
    rt = runtime()
    port = 19500 + os.getpid() % 400
    layers, kv = (2, 2) if QUICK else (8, 8)
    pair_dir = tempfile.mkdtemp(prefix="lock", dir=Session.dir)
    open(os.path.join(pair_dir, "engine.lock"), "w").close()

    def start(cid, g):
        env = ctr_pair.engine_env(port, layers, kv, BIN)
        env.update(GMS_SOCKET_DIR="/run/shadow/gms", SHADOW_LOCK_PATH="/run/shadow/pair/engine.lock",
                   SHADOW_ENGINE_ID="0")
        extra = ["--mount", f"type=bind,src={g.socket_dir},dst=/run/shadow/gms,options=rbind:rw",
                 "--mount", f"type=bind,src={pair_dir},dst=/run/shadow/pair,options=rbind:rw"]
        return Proc(f"ctr-run-{cid}", rt.run_args(ctr_pair.RUNC_RUNTIME, cid, env, [sys.executable, ENGINE],
                                                  extra=extra), stdin=False)

    def answer(proc):
        if proc.p.poll() is not None:
            raise AssertionError(f"{proc.name} ended (rc {proc.p.poll()}): {proc.stderr_tail()}")
        try:
            return request(port, timeout=2.0)["choices"][0]["tokens"]
        except (OSError, http.client.HTTPException, ValueError):
            return None

    g1 = gmsd("cold1")
    first = start("cold1", g1)
    reference = poll_until(lambda: answer(first), 180, "the runc-v2 engine answers")
    kill_at = time.time()
    rt.ctr("task", "kill", "--signal", "SIGKILL", "cold1")
    first.wait(60)
    g1.kill(signal.SIGTERM)
    g1.wait(60)
    g2 = gmsd("cold2")
    second = start("cold2", g2)
    tokens = poll_until(lambda: answer(second), 180, "the restarted engine answers")
    cold_ms = round((time.time() - kill_at) * 1e3, 1)
    assert tokens == reference, "the cold-restarted engine answers differently"
    figure("runc-v2 cold restart of the same engine: SIGKILL -> first correct answer", cold_ms, "ms")
    if STATE.get("shadow_ms_tp1"):
        figure("cold restart / shadow failover (TP=1, through containerd)",
               round(cold_ms / STATE["shadow_ms_tp1"], 1), "x", ">= 50x")
    rt.ctr("task", "kill", "--signal", "SIGKILL", "cold2")
    second.wait(60)
    g2.kill(signal.SIGTERM)
    g2.wait(60)


def test_containerd_pair_tp2():
    """TP=2 needs two GPUs (nvidia-h200-x2); on one it is skipped, and
    says so."""
    n = len(smi("--query-gpu=uuid").splitlines())
    if n < 2:
        raise Skipped(f"{n} GPU on this machine; the TP=2 pair needs 2 (nvidia-h200-x2)")
    containerd_pair(2)

def test_device_memory_back_to_start():
    Session.cleanup()
    start = STATE["baseline_mib"]
    seen = []
    try:
        poll_until(lambda: (lambda m: seen.append(m) or m <= start + 64)(gpu_used_mib()),
                         30, "device memory back to the start")
    except AssertionError:
        raise AssertionError(f"device memory not back to {start} MiB (+64): last readings {seen[-3:]} MiB, "
                             f"compute apps {app_mib()}") from None
    figure("device memory used before / after all tests", f"{start} / {seen[-1]}", "MiB")


def stream_completion(port, prompt, max_tokens, timeout=30.0, gaps=None):
    """One streamed completion (OpenAI's `"stream": true`), read to the end:
    (the response head, its events' data, the longest silence between two
    reads in s); ``gaps`` (a list) gets every silence between reads."""
    s = socket.create_connection(("127.0.0.1", port), timeout=timeout)
    try:
        body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "stream": True}).encode()
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: engine\r\nContent-Type: application/json\r\n"
                  + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        got, last, gap = b"", time.time(), 0.0
        while True:
            b = s.recv(65536)
            now = time.time()
            if not b:
                break
            if gaps is not None:
                gaps.append(now - last)
            gap, last = max(gap, now - last), now
            got += b
    finally:
        s.close()
    head, _, rest = got.partition(b"\r\n\r\n")
    return head, [e[6:] for e in rest.split(b"\n\n") if e.startswith(b"data: ")], gap


def stream_text(head, events):
    """A whole stream's text, or why it is not whole."""
    if not head.startswith(b"HTTP/1.1 200"):
        return None, f"head {head[:60]!r}"
    if not events or events[-1] != b"[DONE]":
        return None, f"no [DONE] after {len(events)} events"
    bodies = [json.loads(e) for e in events[:-1]]
    if len({b["id"] for b in bodies}) != 1:
        return None, "more than one id"
    if bodies[-1]["choices"][0].get("finish_reason") != "length":
        return None, "no final event"
    return "".join(b["choices"][0]["text"] for b in bodies), None


def test_containerd_continuity():
    """Issue 24 on the GPU: the torch engine stores every connection in the
    pair's fd store; streamed and plain completions in flight through three
    SIGKILLs of the serving engine all complete, each identical to an
    undisturbed one; the stall a client saw (longest silence in a cut
    stream) p50 and max."""
    continuity_through_kills("engine")


def test_containerd_continuity_runtime_accepts():
    """The same with `shadow.dev/accept: runtime`: the shim accepts, every
    connection is in the store before the torch engine has it."""
    continuity_through_kills("runtime")


def continuity_through_kills(accept):
    rt = runtime()
    baseline = gpu_used_mib()
    cid, port = f"cont{accept[0]}", 19700 + os.getpid() % 10
    run, events = shadows_pair(rt, cid, port, 1, accept)
    try:
        st = poll_until(lambda: all_parked(rt, cid), 240, "continuity pair: shadow parked")
    except AssertionError:
        raise AssertionError(f"{run.stderr_tail()}\ncontainerd: {rt.log_tail()}") from None
    # Eight streams of 256 tokens and two plain requests always in flight,
    # batched; one event per decoded token.
    prompt, n, streams, plains = "a stream that outlives its engine", 256, 8, 2
    alone = []
    head, evs, _ = stream_completion(port, prompt, n, gaps=alone)
    reference, why = stream_text(head, evs)
    assert reference is not None, why
    plain_ref = request(port, prompt, max_tokens=n, timeout=30)["choices"][0]["text"]
    assert plain_ref == reference, "a stream's text is the plain answer's"
    out, stop, loaded = [], threading.Event(), []

    def client(k):
        while not stop.is_set():
            t = time.time()
            try:
                if k < streams:
                    gaps = []
                    h, e, gap = stream_completion(port, prompt, n, gaps=gaps)
                    text, why = stream_text(h, e)
                    if len(loaded) < 4096:
                        loaded.extend(gaps[2:])
                else:
                    text, why, gap = request(port, prompt, max_tokens=n, timeout=30)["choices"][0]["text"], None, 0.0
            except (OSError, http.client.HTTPException, ValueError, KeyError) as e:
                text, why, gap = None, f"{failure_kind(e)}: {e!r}", 0.0
            out.append((t, time.time(), k < streams, text, why, gap))

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(streams + plains)]
    for th in threads:
        th.start()
    kills = []
    try:
        for k in range(3):
            st = poll_until(lambda: all_parked(rt, cid), 240, f"kill {k}: protected")
            poll_until(lambda: len(out) >= (streams + plains) * (k + 1), 120, "answers before the kill")
            # Mid-stream: a quarter of a stream's time after the last answer.
            time.sleep(0.1)
            kills.append(time.time())
            os.kill(st["pids"][st["pair"]["active"]], signal.SIGKILL)
            poll_until(lambda: (lambda s: s and s["pair"]["failovers"] == k + 1)(rt.state(cid)), 60,
                       f"kill {k}: failed over")
        poll_until(lambda: all_parked(rt, cid), 240, "protected after the kills")
        poll_until(lambda: sum(1 for r in list(out) if r[0] > kills[-1]) >= streams + plains, 120,
                   "requests begun after the last kill answered")
    finally:
        stop.set()
        for th in threads:
            th.join(60)
    bad = [(r[2], r[4]) for r in out if r[3] != reference]
    cut = [r for r in out if any(r[0] < at < r[1] for at in kills)]
    stalls = sorted(round(r[5] * 1e3, 1) for r in cut if r[2])
    evs = list(events)
    resumed = [e for e in evs if e.get("event") == "resumed"]
    carried = [e for e in evs if e.get("event") == "kv-carried"]
    again = [e for e in evs if e.get("event") == "kv-stream-done" and e.get("computed_again")]
    firsts = sorted(e["t"] for e in evs if e.get("event") == "first-answer")
    failover = [round((min(t for t in firsts if t > at) - at) * 1e3, 1) for at in kills
                if any(t > at for t in firsts)]
    step_alone = sorted(alone[2:])[len(alone[2:]) // 2] * 1e3
    step_loaded = sorted(loaded)[len(loaded) // 2] * 1e3 if loaded else None
    print(f"  continuity ({accept} accepts): {len(out)} requests, {len(cut)} cut by a kill ({len(stalls)} streams), "
          f"resumed {[(e.get('connections'), e.get('continued')) for e in resumed]}", flush=True)
    assert not bad, f"{len(bad)} of {len(out)} answers not the undisturbed one: {bad[:5]}"
    assert cut, "no request was in flight at a kill"
    figure(f"continuity ({accept} accepts), torch engine through containerd: requests through 3 SIGKILLs, failed",
           f"{len(bad)} of {len(out)}", "", "0")
    figure(f"continuity ({accept} accepts): requests in flight at a kill (all complete and identical)", len(cut), "")
    figure(f"continuity ({accept} accepts): decode step, one stream alone / {streams} streams (p50 of gaps)",
           f"{step_alone:.2f} / {step_loaded:.2f}" if step_loaded else f"{step_alone:.2f}", "ms")
    figure(f"continuity ({accept} accepts): SIGKILL -> the promoted engine's first answer byte, per kill",
           failover, "ms")
    if stalls:
        target = (sorted(failover)[len(failover) // 2] + 2 * (step_loaded or step_alone)) if failover else None
        figure(f"continuity ({accept} accepts): stall a cut stream saw (longest silence), p50 / max",
               f"{stalls[len(stalls) // 2]} / {stalls[-1]}", "ms",
               f"p50 <= {target:.1f} (failover + 2 steps), max <= 100" if target else "max <= 100")
    figure(f"continuity ({accept} accepts): streams carried (positions from the pool / tail blocks copied)",
           f"{len(carried)} ({sum(e.get('from_pool', 0) for e in carried)} / "
           f"{sum(1 for e in carried if e.get('copied'))})", "")
    # Where a cut stream's stall went, per kill: when each was taken up
    # from the pool (ms after the kill), and the stalls of the streams it
    # cut; the promoted engines' first answers and first steps.
    per_kill = []
    for i, at in enumerate(kills):
        until = kills[i + 1] if i + 1 < len(kills) else float("inf")
        per_kill.append((sorted(round((e["t"] - at) * 1e3, 1) for e in carried if at < e.get("t", 0) < until),
                         sorted(round(r[5] * 1e3, 1) for r in cut if r[2] and r[0] < at < r[1])))
    figure(f"continuity ({accept} accepts): per kill, cut streams taken up from the pool (ms after the kill) / "
           "their stalls", per_kill, "ms")
    figure(f"continuity ({accept} accepts): the promoted engine's lock -> first answer in parts (ms from the lock), "
           "per wake", first_answer_parts(evs), "")
    figure(f"continuity ({accept} accepts): the promoted engine's wait for the cut streams before its first step "
           "(waited ms, sequences waiting, streams still missing), per wake",
           [(e.get("waited_ms"), e.get("streams"), e.get("missing")) for e in evs
            if e.get("event") == "carried-gathered"], "")
    first_steps_figures(f"continuity ({accept} accepts)", evs)
    figure(f"continuity ({accept} accepts): streams computed again (positions, why)",
           [(e.get("computed_again"), e.get("why")) for e in again], "", "none")
    rt.ctr("task", "kill", "--signal", "SIGKILL", cid)
    assert run.wait(60) != 0
    left = poll_until(lambda: (lambda p: None if p else "none")(
        ctr_pair.our_processes([rt.address, rt.state_dir, ENGINE])), 30, "no engine, gmsd or shim left")
    assert left == "none"
    figure(f"continuity ({accept} accepts): device memory before / after", f"{baseline} / {memory_back(baseline)}", "MiB")


def test_torch_engine_tokens_per_second():
    """The engine's throughput at 8 concurrent streams of 256 tokens: the
    batching engine, and (when a copy is at $OLD_TORCH_ENGINE) the engine
    before it, which served one request at a time, on the same weights."""
    engines = [("batching", ENGINE)]
    old = os.environ.get("OLD_TORCH_ENGINE")
    if old and os.path.exists(old):
        engines.append(("serial (before)", old))
    layers = 2 if QUICK else 8
    rates = {}
    for label, path in engines:
        d = tempfile.mkdtemp(prefix="tps-", dir=Session.dir)
        open(os.path.join(d, "engine.lock"), "w").close()
        g = gmsd(f"tps{len(rates)}", lock=os.path.join(d, "engine.lock"))
        port = 18500 + os.getpid() % 100 + len(rates)
        env = {"SHADOW_LOCK_PATH": os.path.join(d, "engine.lock"), "GMS_SOCKET_DIR": g.socket_dir,
               "ENGINE_PORT": str(port), "ENGINE_LAYERS": str(layers), "ENGINE_KV_GIB": "8",
               "SHADOW_ENGINE_ID": "0"}
        e = Proc(f"engine-tps-{len(rates)}", [sys.executable, path], env=env, stdin=False)
        e.event("active", 300)
        prompt = "tokens per second"
        stream_completion(port, prompt, 256)
        done = []

        def one():
            h, evs, _ = stream_completion(port, prompt, 256, timeout=120)
            done.append(sum(1 for x in evs if x.startswith(b"{") and b'"finish_reason":null' in x))
        t0 = time.perf_counter()
        ths = [threading.Thread(target=one) for _ in range(8)]
        for th in ths:
            th.start()
        for th in ths:
            th.join(300)
        wall = time.perf_counter() - t0
        assert len(done) == 8 and all(n == 256 for n in done), done
        rates[label] = round(8 * 256 / wall, 1)
        figure(f"tokens/s at 8 streams of 256 tokens, {label} engine", rates[label], "tokens/s")
        e.kill()
        e.wait(30)
        g.kill(signal.SIGTERM)
        assert g.wait(60) == 0
    if len(rates) == 2:
        figure("tokens/s at 8 streams: batching / serial", round(rates["batching"] / rates["serial (before)"], 2), "x")


# The device-memory check last, whatever the order above.
TESTS = sorted((v for k, v in list(globals().items()) if k.startswith("test_")),
               key=lambda t: t is test_device_memory_back_to_start)


def selected():
    """The tests --only and --part choose, the device-memory check last."""
    tests = [t for t in TESTS if t is not test_device_memory_back_to_start]
    if ONLY:
        tests = [t for t in tests if any(o in t.__name__ for o in ONLY)]
    if PART:
        k, n = PART
        if not 1 <= k <= n:
            raise SystemExit(f"--part {k}/{n}: K must be 1..N")
        tests = [t for i, t in enumerate(tests) if i % n == k - 1]
    return tests + [test_device_memory_back_to_start]


def main():
    Session.dir = tempfile.mkdtemp(prefix="gms-gpu-")
    for tool in ("gmsd", "gms-cuda-bench", "libgms.so"):
        if not os.path.exists(os.path.join(BIN, tool)):
            print(f"missing {BIN}/{tool}: run `make gpu-bundle` on a build machine first")
            print("0 passed, 1 failed, 0 skipped")
            return 1
    print(smi("--query-gpu=name,driver_version,memory.used,memory.total"), flush=True)
    STATE["baseline_mib"] = gpu_used_mib()
    passed = failed = skipped = 0
    t_run = time.monotonic()
    for t in selected():
        t0 = time.monotonic()
        print(f"--- {t.__name__}", flush=True)
        try:
            t()
            outcome = "ok"
        except Skipped as e:
            outcome = f"skip ({e})"
        except Exception:
            outcome = f"FAIL\n{traceback.format_exc()}"
            for p in Session.procs:
                if p.p.poll() is not None or p.name.startswith(("engine", "ctr-run")):
                    tail = p.stderr_tail()
                    if tail:
                        print(f"  [{p.name} stderr] {tail[-800:]}", flush=True)
            if Session.runtime is not None:
                print(f"  [containerd log] {Session.runtime.log_tail(2000)}", flush=True)
        try:
            left = Session.end_test()
        except Exception:
            left = [f"clearing up failed: {traceback.format_exc()}"]
        if left and outcome == "ok":
            outcome = "FAIL"
        for what in left:
            print(f"  LEFT by {t.__name__} (cleared): {what}", flush=True)
        word, _, rest = outcome.partition(" ")
        if outcome.startswith("FAIL"):
            failed += 1
            word, rest = "FAIL", outcome[4:]
        elif outcome.startswith("skip"):
            skipped += 1
        else:
            passed += 1
        print(f"{word:4} {t.__name__} ({time.monotonic() - t0:.1f}s){(' ' + rest) if rest.strip() else ''}",
              flush=True)
    Session.cleanup()
    keep = os.environ.get("GPU_LOG_DIR")
    if keep:
        # containerd's log carries the shim's: keep it for a failure's reader.
        for dirpath, _, files in os.walk(Session.dir):
            for f in files:
                if f.endswith(".log") or f.endswith(".stderr"):
                    shutil.copy(os.path.join(dirpath, f), os.path.join(keep, f"{os.path.basename(dirpath)}-{f}"))
    shutil.rmtree(Session.dir, ignore_errors=True)
    print("\n".join(["== figures =="] + FIGURES), flush=True)
    print(f"{passed} passed, {failed} failed, {skipped} skipped ({time.monotonic() - t_run:.0f} s)", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    finally:
        Session.cleanup()
