"""shadow_vllm.loader (``--load-format gms``) against a real gmsd, host backend.

Engines are separate processes (gms_child.py) on one gmsd: the first loads
a checkpoint and commits, the next maps the committed weights read-only
without the checkpoint; a writer killed before its commit leaves nothing.
The last test runs two vLLM engines (slow: a minute or two each).

Needs gmsd and libgms.so built (``cargo build -p gmsd -p gms-capi``,
release or debug; GMSD / GMS_LIB override) and, for the vLLM test, the
tiny model (``make vllm-model``; SHADOW_VLLM_MODEL overrides).
"""

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import unittest

import torch

HERE = pathlib.Path(__file__).resolve().parent
REPO = HERE.parents[2]
TARGET = pathlib.Path(os.environ.get("CARGO_TARGET_DIR", REPO / "target"))
# One vLLM engine's start and decode: a minute or two alone, up to ten
# beside other busy engines on two cores.
ENGINE_LIMIT_S = 900


def built(name, var):
    """$var, else the newer of target/release/NAME and target/debug/NAME."""
    if os.environ.get(var):
        return os.environ[var]
    found = [p for p in (TARGET / "release" / name, TARGET / "debug" / name) if p.exists()]
    if not found:
        raise unittest.SkipTest(f"{name} is not built (cargo build -p gmsd -p gms-capi) and {var} is unset")
    return str(max(found, key=lambda p: p.stat().st_mtime))


class Gmsd:
    """A gmsd of the host backend in a private socket directory."""

    def __init__(self, extra=()):
        self.tmp = tempfile.TemporaryDirectory(prefix="shadow-vllm-gms-")
        self.dir = os.path.join(self.tmp.name, "gms")
        self.proc = subprocess.Popen([built("gmsd", "GMSD"), "serve", "--device", "host", "--socket-dir",
                                      self.dir, "--log-level", "warn", *extra], stdout=subprocess.DEVNULL)
        self.socket = os.path.join(self.dir, "gms-host.sock")
        deadline = time.monotonic() + 20
        while not os.path.exists(self.socket):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                raise AssertionError(f"gmsd did not come up (exit {self.proc.returncode})")
            time.sleep(0.02)

    def env(self):
        env = dict(os.environ, GMS_SOCKET_DIR=self.dir, GMS_LIB=built("libgms.so", "GMS_LIB"))
        env["PYTHONPATH"] = os.pathsep.join([str(REPO / "gms" / "python"), str(HERE.parent),
                                             env.get("PYTHONPATH", "")])
        return env

    def status(self):
        out = subprocess.run([built("gmsd", "GMSD"), "status", "--socket", self.socket, "--json"],
                             capture_output=True, text=True, timeout=30)
        return out

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.tmp.cleanup()


class Child:
    """One gms_child.py process; its first JSON line is ``first``."""

    def __init__(self, gmsd, role, *args):
        self.proc = subprocess.Popen([sys.executable, str(HERE / "gms_child.py"), role, *args],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     env=gmsd.env())

    def line(self):
        text = self.proc.stdout.readline()
        if not text:
            self.proc.wait(timeout=30)
            raise AssertionError(f"child exited ({self.proc.returncode}) without a line")
        return json.loads(text)

    def end(self):
        if not self.proc.stdin.closed:
            try:
                self.proc.stdin.close()
            except BrokenPipeError:
                pass
        if self.proc.poll() is None:
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc.stdout.close()
        return self.proc.returncode


class LoaderOverHostGms(unittest.TestCase):
    def setUp(self):
        self.gmsd = Gmsd()
        self.children = []
        self.addCleanup(self._clean)
        self.ckpt = os.path.join(self.gmsd.tmp.name, "ckpt.pt")
        gen = torch.Generator().manual_seed(33)
        torch.save({"proj.weight": torch.randn(512, 1024, generator=gen),
                    "norm": torch.randn(512, generator=gen), "scale": torch.tensor(0.5)}, self.ckpt)

    def _clean(self):
        for c in self.children:
            c.end()
        self.gmsd.stop()
        self.assertIsNotNone(self.gmsd.proc.poll(), "gmsd still running")
        for c in self.children:
            self.assertIsNotNone(c.proc.poll(), f"child {c.proc.pid} still running")

    def child(self, role, *args):
        c = Child(self.gmsd, role, *args)
        self.children.append(c)
        return c

    def test_second_engine_maps_the_committed_weights_without_the_checkpoint(self):
        writer = self.child("write", self.ckpt).line()
        os.unlink(self.ckpt)  # the reader cannot read it
        reader = self.child("read").line()
        self.assertEqual((writer["lease"], reader["lease"]), ("ro", "ro"))  # the writer is a reader after commit
        self.assertEqual(reader["tensors"], writer["tensors"])
        # The large weight: the committed memfd, read-only and shared, in both.
        for side in (writer, reader):
            self.assertEqual(side["maps"]["proj.weight"], "r--s", side["maps"])
            for small in ("norm", "scale"):
                self.assertEqual(side["maps"][small][:2], "rw", side["maps"])
        # The same pages at the same address in both, the small ones each
        # engine's own, and the same answer.
        self.assertEqual(writer["shared"], ["proj.weight"])
        self.assertEqual(reader["shared"], ["proj.weight"])
        self.assertEqual(reader["ptrs"]["proj.weight"], writer["ptrs"]["proj.weight"])
        self.assertEqual(reader["output"], writer["output"])
        self.assertEqual(reader["check"]["allocations"], 1)
        self.assertEqual(reader["copied"][0], 2)
        # A parameter of its own class keeps its class and attributes.
        self.assertEqual(reader["norm_kept"], ["Tagged", "kept"])
        self.assertEqual(writer["norm_kept"], ["Tagged", "kept"])

    def test_a_write_into_the_shared_weights_ends_only_the_writer(self):
        first = self.child("write", self.ckpt).line()
        poke = self.child("poke")
        self.assertEqual(poke.line()["small_written"], 2.0)
        self.assertEqual(poke.proc.wait(timeout=60), -signal.SIGSEGV)
        # The other engine, and the committed weights, are untouched.
        again = self.child("read").line()
        self.assertEqual(again["tensors"], first["tensors"])

    def test_a_writer_that_dies_before_commit_leaves_nothing(self):
        dead = self.child("die")
        self.assertEqual(dead.line()["lease"], "rw")
        self.assertEqual(dead.proc.wait(timeout=60), -signal.SIGKILL)
        # The next engine gets the write lease again, on an empty layout.
        writer = self.child("write", self.ckpt).line()
        self.assertEqual(writer["lease"], "ro")
        status = self.gmsd.status()
        self.assertEqual(status.returncode, 0, status.stderr)
        report = json.loads(status.stdout)
        text = json.dumps(report)
        self.assertIn('"generation": 1', text, text[:2000])
        reader = self.child("read").line()
        self.assertEqual(reader["check"]["allocations"], 1)  # only the second writer's


class TwoVllmEnginesShareTheWeights(unittest.TestCase):
    """The pair as vLLM runs it: the first engine loads and commits, the
    second, given a model directory without any weights file, maps them
    and decodes the same greedy tokens."""

    def test_second_engine_attaches_and_answers_the_same(self):
        model = os.environ.get("SHADOW_VLLM_MODEL", str(TARGET / "vllm-model"))
        if not os.path.exists(os.path.join(model, "config.json")):
            raise unittest.SkipTest(f"no model at {model} (make vllm-model)")
        gmsd = Gmsd()
        engines = []

        def clean():
            for p, log in engines:
                if p.poll() is None:
                    os.killpg(p.pid, signal.SIGKILL)
                p.wait()
                p.stdin.close()
                log.close()
            gmsd.stop()

        self.addCleanup(clean)
        weightless = os.path.join(gmsd.tmp.name, "model-without-weights")
        shutil.copytree(model, weightless, ignore=shutil.ignore_patterns("*.safetensors", "*.bin", "*.pt"))
        # vLLM makes its ZMQ sockets and rendezvous files in the temp
        # directory and leaves them when it is killed: the test's own,
        # removed with it, not the machine's /tmp.
        engine_tmp = os.path.join(gmsd.tmp.name, "tmp")
        os.mkdir(engine_tmp)
        env = dict(gmsd.env(), VLLM_CPU_KVCACHE_SPACE="1", TMPDIR=engine_tmp)
        bench = HERE.parent / "bench" / "gms_memory.py"
        results = []
        for i, path in enumerate((model, weightless)):
            log = open(os.path.join(gmsd.tmp.name, f"engine{i}.log"), "w+")
            result = os.path.join(gmsd.tmp.name, f"engine{i}.json")
            p = subprocess.Popen([sys.executable, str(bench), "engine", "--model", path, "--load-format", "gms",
                                  "--tokens", "48", "--runs", "1", "--result", result],
                                 stdin=subprocess.PIPE, stdout=log, stderr=subprocess.STDOUT, text=True, env=env,
                                 start_new_session=True)
            engines.append((p, log))
            # Its figures written (the event), or its exit, within the limit.
            deadline = time.monotonic() + ENGINE_LIMIT_S
            while p.poll() is None and not os.path.exists(result) and time.monotonic() < deadline:
                time.sleep(0.1)
            log.seek(0)
            text = log.read()
            self.assertTrue(os.path.exists(result),
                            f"engine {i}: no figures (exit status {p.poll()}; None: still running "
                            f"after {ENGINE_LIMIT_S} s):\n{text[-3000:]}")
            with open(result) as f:
                results.append((json.load(f), text))
        (first, first_log), (second, second_log) = results
        self.assertIn("weights loaded from the checkpoint and committed", first_log)
        self.assertIn("weights mapped read-only from GMS", second_log)
        self.assertEqual(len(first["tokens"]), 48)
        self.assertEqual(second["tokens"], first["tokens"])


if __name__ == "__main__":
    unittest.main()
