"""shadow_vllm.shm: a slot's /dev/shm files are named after it, and the
next engine of the slot removes what the dead one left, nothing else.
Standard library only (``make test-vllm-unit``)."""

import os
import subprocess
import sys
import tempfile
import textwrap
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
PKG = os.path.dirname(HERE)
GMS = os.path.abspath(os.path.join(PKG, "..", "..", "gms", "python"))
sys.path[:0] = [PKG, GMS]

from shadow_vllm import shm  # noqa: E402

LIMIT_S = 60


class Reclaim(unittest.TestCase):
    def test_removes_the_slots_files_only(self):
        d = tempfile.TemporaryDirectory()
        self.addCleanup(d.cleanup)
        names = ["psm_shadow1_aa_01", "sem.mp-shadow1_aa-x", "psm_shadow0_bb_02", "sem.mp-shadow0_bb-y",
                 "psm_shadow10_cc_03", "psm_1234abcd", "sem.mp-abcdefgh", "other"]
        for n in names:
            open(os.path.join(d.name, n), "w").close()
        self.assertEqual(shm.reclaim(1, d.name), ["psm_shadow1_aa_01", "sem.mp-shadow1_aa-x"])
        self.assertEqual(sorted(os.listdir(d.name)), sorted(set(names) - {"psm_shadow1_aa_01", "sem.mp-shadow1_aa-x"}))

    def test_no_slot_no_tag(self):
        d = tempfile.TemporaryDirectory()
        self.addCleanup(d.cleanup)
        open(os.path.join(d.name, "psm_shadow1_aa_01"), "w").close()
        for env in ({}, {"SHADOW_ENGINE_ID": "x"}, {"SHADOW_ENGINE_ID": "-1"}, {"SHADOW_ENGINE_ID": ""}):
            self.assertEqual(shm.setup(dict(env), d.name), (None, []))
        self.assertEqual(os.listdir(d.name), ["psm_shadow1_aa_01"])


class Naming(unittest.TestCase):
    def test_shared_memory_and_semaphores_of_an_engine_carry_its_tag(self):
        # In a child: apply() changes multiprocessing's naming for the process.
        code = textwrap.dedent(
            """
            import multiprocessing as mp, os, sys
            from multiprocessing import shared_memory
            from shadow_vllm import shm
            tag, _ = shm.setup({"SHADOW_ENGINE_ID": "2"}, sys.argv[1])
            m = shared_memory.SharedMemory(create=True, size=4096)
            lock = mp.get_context("spawn").Lock()
            print(tag, m.name, lock._semlock.name)
            m.close()
            m.unlink()
            """
        )
        d = tempfile.TemporaryDirectory()
        self.addCleanup(d.cleanup)
        out = subprocess.run([sys.executable, "-c", code, d.name], env=dict(os.environ, PYTHONPATH=f"{PKG}:{GMS}"),
                             capture_output=True, text=True, timeout=LIMIT_S, check=True).stdout.split()
        tag, shm_name, sem_name = out
        self.assertTrue(tag.startswith("shadow2_"), tag)
        self.assertTrue(shm_name.startswith(f"psm_{tag}_"), shm_name)
        self.assertTrue(sem_name.startswith(f"/mp-{tag}-"), sem_name)
        # Both are what reclaim() of slot 2 looks for in /dev/shm.
        self.assertTrue(shm_name.startswith(shm._prefixes(2)[0]))
        self.assertTrue(("sem." + sem_name[1:]).startswith(shm._prefixes(2)[1]))


if __name__ == "__main__":
    unittest.main()
