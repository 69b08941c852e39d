"""How long a promoted torch engine takes to read the KV pool's index
before its first step (paged.Blocks.start: the state words only), and how
long the prefix cache's records take after it (Blocks.read_some), for a
pool that fills an H200 (67,000 blocks of 2 MiB) with few blocks in use
and with most of them in use (hours of serving), and what the first
prefix lookup costs while those records are still unread (it reads every
record's hash at once, Blocks.lookup). No GPU, no torch:
``make bench-kv-index``. Medians over repeats; one run compares nothing
with an older version (check one out and run its paged.py the same way).
"""

import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import paged  # noqa: E402

BLOCKS = 67000
REPEATS = 9


def filled(in_use):
    """An index memfd as an engine leaves it: ``in_use`` blocks taken, six
    in seven of them full with a prefix of their own, the rest written."""
    fd = os.memfd_create("bench-kv-index", os.MFD_CLOEXEC)
    os.ftruncate(fd, paged.index_bytes(BLOCKS))
    blocks = paged.Blocks(paged.Index(fd, BLOCKS, 2 << 20, 7))
    blocks.start(True, True)
    for i in range(in_use):
        b = blocks.take()
        if i % 7:
            blocks.full(b, 1000 + i, 0, list(range(paged.BLOCK_TOKENS)))
    return fd


def main():
    for in_use in (500, 60000):
        fd = filled(in_use)
        starts, reads, lookups = [], [], []
        for _ in range(REPEATS):
            b = paged.Blocks(paged.Index(fd, BLOCKS, 2 << 20, 7))
            t0 = time.perf_counter()
            b.start(False, False)
            t1 = time.perf_counter()
            while b.read_some(1024):
                pass
            t2 = time.perf_counter()
            starts.append((t1 - t0) * 1e3)
            reads.append((t2 - t1) * 1e3)
            # A prompt whose first block is the last one filled, asked for
            # before any record is read.
            b = paged.Blocks(paged.Index(fd, BLOCKS, 2 << 20, 7))
            b.start(False, False)
            last = in_use - 1 if (in_use - 1) % 7 else in_use - 2
            t3 = time.perf_counter()
            hit = b.lookup([1000 + last], list(range(paged.BLOCK_TOKENS)))
            lookups.append((time.perf_counter() - t3) * 1e3)
            assert len(hit) == 1, hit
        os.close(fd)
        print(f"index of {BLOCKS} blocks, {in_use} in use: before the first step (state words) "
              f"{statistics.median(starts):.2f} ms, after it (every record, 1024 a turn) "
              f"{statistics.median(reads):.1f} ms, a prefix hit before the records are read "
              f"{statistics.median(lookups):.2f} ms, medians of {REPEATS}")


if __name__ == "__main__":
    main()
