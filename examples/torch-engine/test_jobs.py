"""jobs.py without torch: a worker's jobs reach the connection's thread
token by token, a failure reaches it as the exception, and a step that
does not end shows as stalled (the serving loop stops pinging then)."""

import threading
import time
import unittest

from jobs import SerialWorker


def until(cond, timeout=10.0):
    """Whether ``cond()`` became true within ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


class SerialWorkerTest(unittest.TestCase):
    def test_tokens_arrive_in_order_and_a_failure_is_raised_in_the_reader(self):
        def generate(tokens, max_tokens, step, emit):
            if tokens == [0]:
                raise RuntimeError("the model failed")
            for i in range(max_tokens):
                step()
                emit(tokens[0] + i)

        w = SerialWorker(generate)
        self.assertEqual(list(w.submit([5], 3).tokens()), [5, 6, 7])
        with self.assertRaisesRegex(RuntimeError, "the model failed"):
            list(w.submit([0], 3).tokens())
        self.assertEqual(list(w.submit([9], 1).tokens()), [9], "the worker goes on after a failed job")

    def test_a_step_that_never_ends_shows_as_stalled(self):
        w = SerialWorker(lambda *a: None)
        w.start()
        self.assertFalse(w.stalled(0.0), "idle is not stalled")
        release, inside = threading.Event(), threading.Event()

        def stuck():
            inside.set()
            release.wait()

        w.run_stuck(stuck)
        self.assertTrue(inside.wait(10))
        self.assertTrue(until(lambda: w.stalled(0.05)), "in one step for longer than 50 ms")
        release.set()
        self.assertTrue(until(lambda: not w.stalled(0.05)), "the step ended")

    def test_a_job_cancelled_before_its_turn_is_not_run(self):
        ran = []
        gate = threading.Event()

        def generate(tokens, max_tokens, step, emit):
            gate.wait()
            ran.append(tokens)
            emit(1)

        w = SerialWorker(generate)
        first = w.submit([1], 1)
        second = w.submit([2], 1)
        second.cancel()
        gate.set()
        self.assertEqual(list(first.tokens()), [1])
        self.assertEqual(list(second.tokens()), [])
        self.assertEqual(ran, [[1]])


if __name__ == "__main__":
    unittest.main()
