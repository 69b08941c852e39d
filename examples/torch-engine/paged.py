"""The torch engine's paged KV cache, its bookkeeping: which block of the
pair's KV pool holds what, the prefix cache, and the pool's index that
outlives the engine (docs/engine-contract.md, "Carrying the KV cache").

Why a module of its own: none of it needs torch or a GPU, so the rules a
promoted engine lives by (what it may read at once, what it may write
only after the fence, when a block enters the index) run in ``make test``
(test_paged.py); engine.py launches the kernels and calls in here around
them.

The pool is ``blocks`` blocks of ``BLOCK_TOKENS`` tokens (every layer's K
and V of 16 positions in one contiguous range). Block 0 is scratch: the
padded rows of a batch write there and no real row reads it. Block 1 is
zeros, written by nobody: a block table is padded with it. Every block
an engine takes is zeroed first, so what a row's mask hides is zeros too,
the same in every run. The index (the
pool's memfd, gmsd's like the pool) holds a header, one state word per
block and one record per block:

    header, 64 bytes
     0  8  magic b"SHDWTKIX"
     8  4  version (1), little-endian like every field
    12  4  tokens per block
    16  4  blocks
    20  4  block bytes / 4096
    24  8  the pool's id
    32 32  zero

    then one state word per block (u32, from offset 64): 0 free, 1
    written (someone may be writing it), 2 full; then, from the next 4 KiB
    boundary, one record per block:

    record, 128 bytes
     0  8  prefix hash of a full block in the prefix cache (0: not cached)
     8  8  its parent's hash (0 for a sequence's first block)
    16 64  its 16 token ids (u32), for a full block in the cache
    80 48  zero

A state word is one aligned 4-byte ``pwrite``, and a record one of 128
bytes that never crosses a page: a SIGKILL leaves either old or new, never
half. A block's record is written before the state word that makes it
full (the word is the commit point). The rules:

- a block is marked written (1) before anything is launched into it;
- it becomes full (2), with its hash when it enters the prefix cache, only
  once all of its positions are written and synchronised;
- it is marked free (0) only when nothing launched into it is pending.

So a promoted engine may at once read (and share) full blocks, write into
free ones, and must not write a block marked written before the fence
passes: the dead engine may still be writing it. A sequence it carries
whose tail lies in such a block gets the tail copied to a free block.
"""

import hashlib
import os
import re
import struct
from collections import OrderedDict

BLOCK_TOKENS = 16
SCRATCH_BLOCK, ZERO_BLOCK = 0, 1
# Blocks no sequence ever holds.
RESERVED_BLOCKS = 2
MAGIC = b"SHDWTKIX"
VERSION = 1
HEADER = 64
RECORD = 128
FREE, WRITTEN, FULL = 0, 1, 2


def _records_at(blocks):
    return -(-(HEADER + 4 * blocks) // 4096) * 4096


def index_bytes(blocks):
    """Bytes of the index of a pool of ``blocks`` blocks."""
    return _records_at(blocks) + RECORD * blocks


def block_hash(parent, tokens):
    """The prefix hash of a full block: its tokens and everything before
    them (``parent``, the hash of the block before; 0 for the first).
    Never 0."""
    h = hashlib.blake2b(struct.pack("<Q", parent) + struct.pack(f"<{len(tokens)}I", *tokens),
                        digest_size=8, person=b"shadow-kv-block")
    return int.from_bytes(h.digest(), "little") or 1


def prompt_hashes(tokens, upto):
    """The chained hashes of the full blocks of ``tokens`` that end at or
    before ``upto`` tokens."""
    out, parent = [], 0
    for b in range(upto // BLOCK_TOKENS):
        parent = block_hash(parent, tokens[b * BLOCK_TOKENS:(b + 1) * BLOCK_TOKENS])
        out.append(parent)
    return out


# A run of blocks in use (state words whose low byte is not zero).
_IN_USE = re.compile(rb"[^\x00]+")


class Index:
    """The pool's index over its memfd (pread/pwrite; the memfd is
    libgms's). Writes go straight to the memfd: what is there is what a
    promoted engine reads."""

    def __init__(self, fd, blocks, block_bytes, pool):
        self.fd, self.blocks, self.block_bytes, self.pool = fd, blocks, block_bytes, pool
        self.records_at = _records_at(blocks)

    def header(self):
        return MAGIC + struct.pack("<IIIIQ", VERSION, BLOCK_TOKENS, self.blocks, self.block_bytes // 4096,
                                   self.pool) + bytes(HEADER - 32)

    def valid(self):
        """Whether the memfd holds an index of this very pool and geometry."""
        return os.pread(self.fd, HEADER, 0) == self.header()

    def reset(self):
        """Every block free, then the header: an index found without its
        header is never trusted."""
        os.pwrite(self.fd, bytes(HEADER), 0)
        os.pwrite(self.fd, bytes(4 * self.blocks), HEADER)
        os.pwrite(self.fd, self.header(), 0)

    def set(self, block, state, hash_=0, parent=0, tokens=()):
        """A block's state; a full one's record first (its state word is the
        commit point)."""
        if state == FULL:
            rec = struct.pack("<QQ", hash_, parent)
            if tokens:
                rec += struct.pack(f"<{len(tokens)}I", *tokens)
            os.pwrite(self.fd, rec + bytes(RECORD - len(rec)), self.records_at + RECORD * block)
        os.pwrite(self.fd, struct.pack("<I", state), HEADER + 4 * block)

    def states(self):
        """(free blocks, full blocks, {block: state} of the others), each in
        ascending order, of every block a sequence may hold, from the state
        words in one read (a word's low byte is its state: they are 0 to
        2). A promoted engine reads this on its way to its first answer,
        and a pool that fills a GPU has 67,000 blocks: the runs of blocks
        in use are found in C, the free list is built of the ranges
        between them, and only blocks in use are looked at one by one."""
        raw = os.pread(self.fd, 4 * self.blocks, HEADER)
        n = len(raw) // 4
        low = raw[0:4 * n:4]
        free, full, other = [], [], {}
        at = RESERVED_BLOCKS
        for m in _IN_USE.finditer(low, RESERVED_BLOCKS):
            free.extend(range(at, m.start()))
            for b in range(m.start(), m.end()):
                if low[b] == FULL:
                    full.append(b)
                else:
                    other[b] = low[b]
            at = m.end()
        free.extend(range(at, n))
        return free, full, other

    def record_hashes(self):
        """Every block's record's prefix hash (0: none), from one read of
        the records: a list indexed by block. Only the hashes are decoded
        (a slice of the raw words), so that 67,000 records take
        milliseconds, not the tens a parse of each would."""
        raw = os.pread(self.fd, RECORD * self.blocks, self.records_at)
        raw += bytes(RECORD * self.blocks - len(raw))
        return memoryview(raw).cast("Q")[::RECORD // 8].tolist()

    def read_records(self, blocks):
        """[(block, hash, parent, tokens)] of ``blocks`` (ascending): one
        read per run of consecutive blocks."""
        out, i = [], 0
        while i < len(blocks):
            j = i + 1
            while j < len(blocks) and blocks[j] == blocks[j - 1] + 1:
                j += 1
            first, count = blocks[i], j - i
            raw = os.pread(self.fd, RECORD * count, self.records_at + RECORD * first)
            for k in range(min(count, len(raw) // RECORD)):
                h, parent = struct.unpack_from("<QQ", raw, RECORD * k)
                toks = struct.unpack_from(f"<{BLOCK_TOKENS}I", raw, RECORD * k + 16)
                out.append((first + k, h, parent, toks))
            i = j
        return out


class NoBlocks(Exception):
    """The pool has no block for a sequence now (all are in use)."""


class Blocks:
    """Which block holds what, for the one thread that launches work into
    the pool (engine.py's batch loop): free blocks, references, the prefix
    cache (full blocks by hash, least recently used first when evicted),
    the blocks set aside until the fence, and the index kept in step."""

    def __init__(self, index):
        self.index = index
        self.free = []
        self.refs = {}
        self.cached = {}            # hash -> block
        self.cached_of = {}         # block -> (hash, parent, tokens)
        self.evictable = OrderedDict()  # block -> None: cached, unreferenced
        self.aside = set()          # written by an engine before, not to be written before the fence
        self.pinned = {}            # block -> pins: a carried sequence's, until it is taken up
        self.unread = []            # full blocks found at the start whose records are not read yet
        self.unread_set = set()     # the same blocks (``unread`` may also hold some read since)
        self._unread_by_hash = None  # hash -> unread block, made by the first lookup that needs it
        self.fenced = True
        # Evictions wait until every carried sequence has pinned its blocks.
        self.may_evict = True
        # Blocks from this one on are not mapped yet (a pool granted with
        # its first part mapped, the rest coming): None once all are.
        self.limit = None
        self.figures = {"adopted_full": 0, "adopted_cached": 0, "aside": 0}

    # -- the start: a new pool, or one an engine wrote before -------------
    def start(self, created, fenced):
        """Takes the pool as granted: ``created`` (nothing in it) resets the
        index; else it is adopted as the index says, and until ``fenced``
        blocks marked written stay aside. Only the state words are read
        now: the full blocks' records (the prefix cache) are read after,
        ``read_some`` at a time, off the first answer's path (a pool that
        fills a GPU after hours of serving holds tens of thousands). Until
        its record is read, a full block may be pinned and taken up by a
        carried stream, is neither freed nor evicted, and is found by a
        prefix lookup through its hash alone (``lookup``)."""
        self.fenced = fenced
        if created or not self.index.valid():
            self.index.reset()
            self.free = list(range(self.index.blocks - 1, RESERVED_BLOCKS - 1, -1))
            return "new"
        self.may_evict = False
        free, full, other = self.index.states()
        # Written (or a state this engine does not know): someone may be
        # writing it.
        self.aside.update(other)
        self.figures["aside"] = len(other)
        self.unread = full
        self.unread.reverse()
        self.unread_set = set(self.unread)
        self.figures["unread"] = len(self.unread)
        free.reverse()
        self.free = free
        return "adopted"

    def read_some(self, n):
        """Reads the records of up to ``n`` full blocks found at the start
        (lowest first): each one holding a prefix not cached yet enters the
        prefix cache (evictable unless a sequence holds it); one without a
        hash, or a copy of a cached prefix, is set aside as any block
        nobody may reuse before the fence. Returns how many are left."""
        batch = []
        while self.unread and len(batch) < n:
            b = self.unread.pop()
            if b in self.unread_set:  # else a lookup read it already
                batch.append(b)
        self._adopt(self.index.read_records(batch))
        if not self.unread_set:
            self.unread, self._unread_by_hash = [], None
        return len(self.unread_set)

    def _adopt(self, records):
        """Full blocks whose records are now read: each one holding a
        prefix not cached yet enters the prefix cache, the others are set
        aside."""
        for b, h, parent, toks in records:
            self.unread_set.discard(b)
            if h and h not in self.cached:
                self.cached[h] = b
                self.cached_of[b] = (h, parent, toks)
                if b not in self.refs and b not in self.pinned:
                    self.evictable[b] = None
                self.figures["adopted_cached"] += 1
            else:
                # Full but in no cache: a carried sequence's, or nobody's.
                self.aside.add(b)
                self.figures["adopted_full"] += 1
                self._maybe_release(b)

    def _unread_hit(self, h):
        """The cached block of prefix ``h`` among the full blocks whose
        records are not read yet, its record read (and the block adopted)
        now; None if none holds it. A request that shares a prefix with
        the dead engine's and comes before ``read_some`` got there is a
        hit, not a prompt computed again: the first such lookup reads
        every record's hash at once (a few milliseconds for a pool that
        fills a GPU), and the records of unread blocks do not change."""
        if not self.unread_set:
            return None
        if self._unread_by_hash is None:
            hashes = self.index.record_hashes()
            self._unread_by_hash = {hashes[b]: b for b in self.unread_set if hashes[b]}
            self.figures["unread_hashed"] = len(self.unread_set)
        b = self._unread_by_hash.pop(h, None)
        if b is None or b not in self.unread_set:
            return None
        self._adopt(self.index.read_records([b]))
        return self.cached.get(h)

    def fence_passed(self):
        """No engine before can write any more: once every carried sequence
        has pinned its blocks too, the blocks set aside that none holds are
        free."""
        if not self.fenced:
            self.fenced = True
            self._release_aside()

    def _settled(self):
        return self.fenced and self.may_evict

    def _release_aside(self):
        if not self._settled():
            return
        for b in sorted(self.aside):
            if b not in self.pinned and b not in self.refs:
                self.aside.discard(b)
                self.index.set(b, FREE)
                self.free.append(b)

    def carried_done(self):
        """Every carried sequence pinned what it needs: the prefix cache may
        be evicted from now on, and (past the fence) the blocks set aside
        that none holds are free."""
        self.may_evict = True
        self._release_aside()

    # -- pins: a carried sequence's blocks, between the fetch and its turn -
    def pin(self, blocks):
        """Pins a carried sequence's blocks until it takes them up: True
        when every one may be read (full, or written by an engine before
        and freed by none), else nothing is pinned."""
        if not all(RESERVED_BLOCKS <= b < self.index.blocks and self.readable(b) for b in blocks):
            return False
        for b in blocks:
            self.pinned[b] = self.pinned.get(b, 0) + 1
            self.evictable.pop(b, None)
        return True

    def unpin(self, blocks):
        for b in blocks:
            self._drop(self.pinned, b)

    def readable(self, block):
        """Whether a carried block may be read: in the prefix cache, or
        written by an engine before and freed by none (the index said so at
        the grant, and this engine has not reused it)."""
        return block in self.cached_of or block in self.aside or block in self.unread_set

    def writable_in_place(self, block):
        """Whether a carried tail block may be written where it is: no
        engine before can write it any more."""
        return self.fenced or block not in self.aside

    # -- the part of the pool that is mapped -------------------------------
    def mapped(self, block):
        """Whether ``block`` lies in the part of the pool mapped so far."""
        return self.limit is None or block < self.limit

    def set_mapped(self, blocks):
        """The first ``blocks`` blocks are mapped (all of them: no limit)."""
        self.limit = None if blocks >= self.index.blocks else blocks

    # -- allocation -------------------------------------------------------
    def available(self):
        if self.limit is None:
            return len(self.free) + (len(self.evictable) if self.may_evict else 0)
        return (sum(1 for b in self.free if b < self.limit)
                + (sum(1 for b in self.evictable if b < self.limit) if self.may_evict else 0))

    def has_available(self, n):
        """Whether ``n`` blocks can be taken now. While part of the pool is
        mapped, counts only until it has ``n``, from the top of the free
        stack (where the lowest blocks are): a pool that fills a GPU has
        tens of thousands of free blocks, and this is asked on the first
        answer's path."""
        if self.limit is None:
            return self.available() >= n
        got = 0
        for b in reversed(self.free):
            got += b < self.limit
            if got >= n:
                return True
        if self.may_evict:
            for b in self.evictable:
                got += b < self.limit
                if got >= n:
                    return True
        return got >= n

    def take(self):
        """A block to write: a free one, else the least recently used
        cached one nobody holds; marked written in the index first. While
        only part of the pool is mapped, one of that part."""
        b = self._free_one()
        if b is None and self.may_evict:
            b = next((e for e in self.evictable if self.mapped(e)), None)
            if b is not None:
                del self.evictable[b]
                h, _, _ = self.cached_of.pop(b)
                del self.cached[h]
        if b is None:
            raise NoBlocks(f"all {self.index.blocks - RESERVED_BLOCKS} blocks in use"
                           + (f" (the first {self.limit} mapped so far)" if self.limit is not None else ""))
        self.index.set(b, WRITTEN)
        self.refs[b] = 1
        return b

    def _free_one(self):
        if self.free and self.mapped(self.free[-1]):
            return self.free.pop()
        for i in range(len(self.free) - 2, -1, -1):
            if self.mapped(self.free[i]):
                return self.free.pop(i)
        return None

    def share(self, block):
        """One more reference to a full block (a prefix hit, a carried one)."""
        self.refs[block] = self.refs.get(block, 0) + 1
        self.evictable.pop(block, None)

    def own_carried(self, block, full):
        """A carried block taken up in place: referenced; a ``full`` one is
        marked so (nobody writes it again: every position of it was
        committed)."""
        self.share(block)
        if full and block not in self.cached_of and block not in self.unread_set:
            self.index.set(block, FULL)

    def release(self, block):
        self._drop(self.refs, block)

    def _drop(self, counts, b):
        """One reference (or pin) fewer on ``b``; at none, it may go."""
        n = counts.get(b, 0) - 1
        if n > 0:
            counts[b] = n
            return
        counts.pop(b, None)
        self._maybe_release(b)

    def _maybe_release(self, b):
        """A block nobody references or pins any more: a cached one stays
        (evictable), one set aside waits for the fence, others are free.
        Only called once nothing launched into it is pending."""
        if b in self.refs or b in self.pinned or b in self.unread_set:
            return
        if b in self.cached_of:
            self.evictable[b] = None
            return
        if b in self.aside:
            if not self._settled():
                return
            self.aside.discard(b)
        self.index.set(b, FREE)
        self.free.append(b)

    # -- the prefix cache -------------------------------------------------
    def lookup(self, hashes, tokens):
        """The cached blocks of a prompt's first full blocks, in order, up
        to the first miss (each checked against the tokens it holds; one
        not mapped yet is a miss: ``prefix_unmapped`` says when waiting
        for it would do better)."""
        hits = []
        for b in self._prefix(hashes, tokens):
            if not self.mapped(b):
                break
            hits.append(b)
        return hits

    def prefix_unmapped(self, hashes, tokens):
        """Whether a prompt's cached prefix runs into a block not mapped
        yet: the prompt would rather wait for the mapping (milliseconds)
        than compute that part again."""
        return self.limit is not None and any(not self.mapped(b) for b in self._prefix(hashes, tokens))

    def _prefix(self, hashes, tokens):
        """The cached blocks of a prompt's first full blocks, in order, up
        to the first miss, mapped or not."""
        for i, h in enumerate(hashes):
            b = self.cached.get(h)
            if b is None:
                b = self._unread_hit(h)
            if b is None:
                return
            _, _, toks = self.cached_of[b]
            if list(toks) != list(tokens[i * BLOCK_TOKENS:(i + 1) * BLOCK_TOKENS]):
                return
            yield b

    def full(self, block, hash_, parent, tokens):
        """All of ``block``'s positions are written and synchronised: it is
        full, and enters the prefix cache under ``hash_`` unless another
        block holds that prefix already."""
        if hash_ in self.cached:
            self.index.set(block, FULL)
            return False
        self.cached[hash_] = block
        self.cached_of[block] = (hash_, parent, tuple(tokens))
        self.index.set(block, FULL, hash_, parent, tokens)
        return True
