"""The torch engine's KV bookkeeping (paged.py) without torch: the index
in a memfd as a promoted engine finds it, and the rules it lives by (what
it may share at once, what waits for the fence, what a carried stream
pins, when the prefix cache may be evicted)."""

import os
import struct
import unittest

import paged
from paged import FREE, FULL, RESERVED_BLOCKS, WRITTEN, Blocks, Index, NoBlocks


def index(blocks=16, pool=7):
    fd = os.memfd_create("test-kv-index", os.MFD_CLOEXEC)
    os.ftruncate(fd, paged.index_bytes(blocks))
    return Index(fd, blocks, 2 << 20, pool)


def state(ix, block):
    return struct.unpack("<I", os.pread(ix.fd, 4, paged.HEADER + 4 * block))[0]


def toks(start):
    return list(range(start, start + paged.BLOCK_TOKENS))


class IndexTest(unittest.TestCase):
    def tearDown(self):
        for ix in getattr(self, "ixs", []):
            os.close(ix.fd)

    def ix(self, *a, **kw):
        ix = index(*a, **kw)
        self.ixs = getattr(self, "ixs", []) + [ix]
        return ix

    def test_a_new_pool_is_all_free_but_the_reserved_blocks(self):
        ix = self.ix()
        self.assertFalse(ix.valid(), "a zeroed memfd holds no index")
        b = Blocks(ix)
        self.assertEqual(b.start(created=True, fenced=True), "new")
        self.assertTrue(ix.valid())
        self.assertEqual(sorted(b.free), list(range(RESERVED_BLOCKS, 16)))
        self.assertEqual(Index(ix.fd, 16, 2 << 20, pool=8).valid(), False, "another pool's index is not trusted")

    def test_a_block_is_written_before_use_full_once_committed_free_once_released(self):
        b = Blocks(self.ix())
        b.start(True, True)
        blk = b.take()
        self.assertEqual(state(b.index, blk), WRITTEN)
        h = paged.block_hash(0, toks(0))
        self.assertTrue(b.full(blk, h, 0, toks(0)))
        self.assertEqual(state(b.index, blk), FULL)
        b.release(blk)
        self.assertEqual(state(b.index, blk), FULL, "a cached block stays, for the next prompt that shares it")
        self.assertIn(blk, b.evictable)
        tail = b.take()
        b.release(tail)
        self.assertEqual(state(b.index, tail), FREE, "a partial block nobody holds is free")

    def test_the_prefix_cache_checks_the_tokens_and_stops_at_the_first_miss(self):
        b = Blocks(self.ix())
        b.start(True, True)
        prompt = toks(0) + toks(100) + toks(200)
        hashes = paged.prompt_hashes(prompt, len(prompt))
        self.assertEqual(len(hashes), 3)
        self.assertNotEqual(hashes[1], paged.block_hash(0, toks(100)), "a block's hash covers what comes before it")
        first, second = b.take(), b.take()
        b.full(first, hashes[0], 0, toks(0))
        b.full(second, hashes[1], hashes[0], toks(100))
        self.assertEqual(b.lookup(hashes, prompt), [first, second])
        other = toks(0) + toks(999)
        self.assertEqual(b.lookup(paged.prompt_hashes(other, len(other)), other), [first])

    def test_evicting_takes_the_least_recently_used_cached_block(self):
        b = Blocks(self.ix(blocks=RESERVED_BLOCKS + 2))
        b.start(True, True)
        x, y = b.take(), b.take()
        b.full(x, 11, 0, toks(0))
        b.full(y, 22, 0, toks(50))
        b.release(x)
        b.release(y)
        self.assertEqual(b.take(), x)
        self.assertNotIn(11, b.cached)
        self.assertEqual(b.take(), y)
        with self.assertRaises(NoBlocks):
            b.take()


    def test_while_part_of_the_pool_is_mapped_only_that_part_is_used(self):
        # A pool granted with its first part mapped (the rest on libgms's
        # thread): new blocks come from that part, a cached block past it
        # is a miss, and once all is mapped every block is usable again.
        b = Blocks(self.ix(blocks=16))
        b.start(True, True)
        far = [b.take() for _ in range(14)][-1]
        self.assertEqual(far, 15)
        h = paged.block_hash(0, toks(0))
        b.full(far, h, 0, toks(0))
        for blk in range(RESERVED_BLOCKS, 15):
            b.release(blk)
        b.release(far)
        b.set_mapped(6)
        self.assertEqual(b.lookup([h], toks(0)), [], "a cached block not mapped yet is a miss")
        self.assertTrue(b.prefix_unmapped([h], toks(0)), "which the prompt may wait for")
        self.assertFalse(b.prefix_unmapped([h], toks(1)), "a prefix not cached: nothing to wait for")
        self.assertEqual(b.available(), 6 - RESERVED_BLOCKS)
        self.assertTrue(b.has_available(6 - RESERVED_BLOCKS))
        self.assertFalse(b.has_available(6 - RESERVED_BLOCKS + 1), "blocks past the limit do not count")
        got = [b.take() for _ in range(6 - RESERVED_BLOCKS)]
        self.assertTrue(all(blk < 6 for blk in got), got)
        with self.assertRaisesRegex(NoBlocks, "first 6 mapped"):
            b.take()
        b.set_mapped(16)
        self.assertIsNone(b.limit)
        self.assertEqual(b.lookup([h], toks(0)), [far])
        self.assertFalse(b.prefix_unmapped([h], toks(0)))
        self.assertEqual(b.take(), 14, "free blocks past the old limit")

class AdoptionTest(unittest.TestCase):
    """What a promoted engine finds: a cached full block (1), a full block
    of a carried sequence in no cache (2), a tail the dead engine was
    writing (3), and free blocks."""

    def setUp(self):
        self.ix = index()
        dead = Blocks(self.ix)
        dead.start(True, True)
        self.cached, self.full, self.tail = dead.take(), dead.take(), dead.take()
        dead.full(self.cached, 11, 0, toks(0))
        dead.full(self.full, 11, 0, toks(0))  # the same prefix: not cached twice
        self.b = Blocks(self.ix)
        self.assertEqual(self.b.start(created=False, fenced=False), "adopted")
        self.assertEqual(self.b.read_some(1 << 20), 0)

    def tearDown(self):
        os.close(self.ix.fd)

    def test_full_blocks_are_readable_at_once_written_ones_wait_for_the_fence(self):
        b = self.b
        self.assertEqual(b.cached, {11: self.cached})
        self.assertTrue(b.readable(self.cached) and b.readable(self.full) and b.readable(self.tail))
        self.assertFalse(b.writable_in_place(self.tail), "the dead engine may still be writing it")
        self.assertNotIn(self.tail, b.free)
        self.assertNotIn(self.full, b.free)
        self.assertEqual(b.figures, {"adopted_full": 1, "adopted_cached": 1, "aside": 1, "unread": 2})

    def test_nothing_is_evicted_or_freed_until_every_carried_stream_pinned(self):
        b = self.b
        b.fence_passed()
        self.assertTrue(b.writable_in_place(self.tail))
        self.assertNotIn(self.tail, b.free, "the fetch may still bring a stream that holds it")
        self.assertTrue(b.pin([self.cached, self.tail]))
        b.carried_done()
        self.assertIn(self.full, b.free, "nobody pinned it: free once settled")
        self.assertEqual(state(self.ix, self.full), FREE)
        self.assertNotIn(self.tail, b.free)
        b.unpin([self.cached, self.tail])
        self.assertIn(self.tail, b.free)
        self.assertIn(self.cached, b.evictable, "a cached block stays cached")

    def test_a_block_someone_reused_cannot_be_pinned(self):
        b = self.b
        b.fence_passed()
        b.carried_done()
        reused = b.take()
        self.assertFalse(b.pin([self.cached, reused]), "a block this engine took holds none of the dead one's KV")
        self.assertNotIn(self.cached, b.pinned, "nothing is pinned when one block cannot be")

    def test_a_carried_full_block_taken_up_is_marked_full(self):
        b = self.b
        self.assertTrue(b.pin([self.full]))
        b.own_carried(self.full, full=True)
        b.unpin([self.full])
        self.assertEqual(state(self.ix, self.full), FULL)
        b.fence_passed()
        b.carried_done()
        self.assertNotIn(self.full, b.free, "still referenced")
        b.release(self.full)
        self.assertIn(self.full, b.free)

    def test_full_blocks_records_are_read_after_the_start_and_kept_till_then(self):
        # The start reads the state words only; until a full block's record
        # is read it may be pinned and taken up, and is neither freed nor
        # evicted, whatever the fence and the pins say.
        b = Blocks(self.ix)
        b.start(created=False, fenced=False)
        self.assertEqual((b.figures["unread"], b.cached), (2, {}))
        self.assertTrue(b.pin([self.cached]) and b.readable(self.full))
        b.own_carried(self.cached, full=True)
        b.unpin([self.cached])
        b.fence_passed()
        b.carried_done()
        self.assertFalse({self.cached, self.full} & set(b.free), "unread full blocks are kept")
        self.assertEqual(b.read_some(1), 1)
        (_, h, _, _), = self.ix.read_records([self.cached])
        self.assertEqual(h, 11, "taking it up did not overwrite its record")
        self.assertEqual(b.lookup([11], toks(0)), [self.cached], "read: a prefix hit")
        self.assertNotIn(self.cached, b.evictable, "held by the stream that took it up")
        self.assertEqual(b.read_some(10), 0)
        self.assertIn(self.full, b.free, "a copy of a cached prefix nobody holds: free, past the fence")
        b.release(self.cached)
        self.assertIn(self.cached, b.evictable)

    def test_a_prefix_in_a_block_not_read_yet_is_a_hit_all_the_same(self):
        # A request that shares the dead engine's prefix and comes before
        # the records are read: its lookup finds the block by the hashes,
        # read at once, reads that one record, and the block is cached from
        # then on; the records read after skip it.
        b = Blocks(self.ix)
        b.start(created=False, fenced=True)
        self.assertEqual(b.lookup([11], toks(0)), [self.cached], "a hit before the records are read")
        self.assertEqual(b.lookup([11], toks(1)), [], "its tokens are checked as any hit's")
        self.assertEqual(b.lookup([12], toks(0)), [], "a prefix no block holds")
        self.assertEqual((b.figures["adopted_cached"], b.figures["unread_hashed"]), (1, 2))
        self.assertEqual(b.read_some(10), 0)
        self.assertEqual((b.figures["adopted_cached"], b.figures["adopted_full"]), (1, 1),
                         "each record adopted once: the one read by the lookup skipped")
        self.assertEqual(b.cached, {11: self.cached})


if __name__ == "__main__":
    unittest.main()
