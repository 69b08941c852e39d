"""Requests as jobs of the one thread that runs the model, and the threads
that answer connections waiting on them.

Why a module of its own: the serving loop (engine.serve) speaks to a
worker through this interface whatever runs the model, a batch loop
(batching.py, one GPU) or one request at a time (a tensor-parallel group,
the tests' fake model), and none of it needs torch, so it runs in ``make
test``. The loop that pings the watchdog is not the one that runs the
model: it pings only while the worker makes progress (``stalled``).
"""

import queue
import threading
import time

# A job's queue carries token ids, then one of these.
END = object()


class KvUnavailable(Exception):
    """The KV cache has no room for a request (it is larger than all of it)."""


class Job:
    """One request's tokens as the worker decodes them. The connection's
    thread reads them (``tokens()``); ``cancel()`` (its client went away)
    has the worker drop the request at its next step."""

    def __init__(self, prompt, max_tokens, progress=None):
        self.prompt, self.max_tokens, self.progress = prompt, max_tokens, progress
        self.q = queue.SimpleQueue()
        self.cancelled = False
        # Prompt tokens whose KV came from the prefix cache, as the worker
        # found them when it started the job (OpenAI's
        # usage.prompt_tokens_details.cached_tokens).
        self.cached = 0

    def put(self, token):
        self.q.put(token)

    def end(self, error=None):
        self.q.put(END if error is None else error)

    def tokens(self):
        """Each token as it is decoded; raises what ended the job badly."""
        while True:
            t = self.q.get()
            if t is END:
                return
            if isinstance(t, BaseException):
                raise t
            yield t

    def cancel(self):
        self.cancelled = True


class Worker:
    """The thread that runs the model, and how far it got: ``stalled(s)``
    says whether it has been in one step for more than ``s`` seconds (the
    serving loop stops pinging the watchdog then)."""

    def __init__(self, name):
        self.name = name
        self.inbox = queue.SimpleQueue()
        self._step_at = None
        self._thread = None

    def start(self):
        if self._thread is None:
            self._thread = threading.Thread(target=self._main, name=self.name, daemon=True)
            self._thread.start()

    def stepping(self):
        """A step begins (or goes on: a decode step of a long request)."""
        self._step_at = time.monotonic()

    def idle(self):
        self._step_at = None

    def stalled(self, seconds):
        at = self._step_at
        return at is not None and time.monotonic() - at > seconds

    def run_stuck(self, fn):
        """Runs ``fn`` on the worker's thread (the test hang: a step that
        never ends)."""
        self.inbox.put(("call", fn))

    # What a batch worker does with carried streams; nothing here.
    def wake(self, lock_fd):
        self.start()

    def pin(self, name, carried):
        pass

    def unpin(self, name):
        pass

    def carried_done(self):
        pass

    def _main(self):
        raise NotImplementedError


class SerialWorker(Worker):
    """One request at a time through ``generate(tokens, max_tokens, step,
    emit)`` (a tensor-parallel group's, the tests' fake model): what the
    engine did before it batched. A resumed stream is computed again from
    its prompt."""

    def __init__(self, generate):
        super().__init__("serial-worker")
        self.generate = generate

    def submit(self, prompt, max_tokens, progress=None):
        self.start()
        job = Job(prompt, max_tokens, progress)
        self.inbox.put(("job", job))
        return job

    def _main(self):
        while True:
            kind, what = self.inbox.get()
            if kind == "call":
                self.stepping()
                what()
                self.idle()
                continue
            job = what
            if job.cancelled:
                job.end()
                continue
            self.stepping()
            try:
                self.generate(job.prompt, job.max_tokens, self.stepping, job.put)
                job.end()
            except Exception as e:  # noqa: BLE001 (handed to the request's thread)
                job.end(e)
            finally:
                self.idle()
