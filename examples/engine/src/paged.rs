//! The paged KV cache, in the pair's KV pool: what lets a promoted engine
//! go on with a stream from the last token its predecessor committed
//! instead of computing the whole stream again.
//!
//! The pool is gmsd's (`gms::kvpool`): the same pages for every engine
//! that holds the election lock in turn. It is cut in blocks of
//! [`BLOCK_TOKENS`] entries; an entry is what one decode step leaves (the
//! activation after it, the running state, the token's index in the
//! vocabulary), so a sequence of `n` tokens owns `ceil(n / BLOCK_TOKENS)`
//! blocks. Which block belongs to which sequence is the pool's index (a
//! memfd gmsd keeps with the pool):
//!
//! ```text
//! offset size
//!  0      8   magic "SHDWKVIX"
//!  8      4   version (1), little-endian like every field
//! 12      4   tokens per block
//! 16      8   bytes per block
//! 24      8   blocks
//! 32      8   the pool's id (an index of another pool is not ours)
//! 40     24   zero
//! 64      …   per block, 16 bytes: owner (the FNV-1a 64 of the
//!             sequence's name in the fd store; 0: free), the block's
//!             ordinal in that sequence (u32), zero (u32)
//! ```
//!
//! The commit rule: a block's record is written (one 16-byte `pwrite`)
//! before any entry goes into the block; an entry is written before the
//! connection's progress word says its token was sent (`continuity`); a
//! record is cleared only after the sequence's last write. So whatever a
//! connection's state says was sent has its entries in blocks the index
//! names, and a promoted engine reads them at once.
//!
//! What it may not do at once is write where its predecessor may still
//! have been writing (on a GPU, kernels run on for 110 to 150 ms after a
//! SIGKILL): the tail block of a sequence it goes on with, blocks beyond
//! it, and blocks of sequences nobody goes on with. Until the pool's
//! fence has passed it copies a resumed sequence's partial tail into a
//! fresh block and keeps those blocks aside; blocks free in the index were
//! never written by anyone since they were freed, and full blocks are
//! never written again, so both are used at once.

use std::collections::{HashMap, HashSet};
use std::os::fd::BorrowedFd;
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Mutex;

use gms::kvpool::KvPool;
use gms::mapper::{HostMapper, HostRange};
use shadow_engine::model::{word_index, Decoder, Model, COLS};

/// Tokens per block.
pub const BLOCK_TOKENS: usize = 16;
/// One decode step: the activation (`COLS` f32), the running state (u64),
/// the token's index (u32), padding.
pub const ENTRY_BYTES: usize = COLS * 4 + 16;
pub const BLOCK_BYTES: usize = BLOCK_TOKENS * ENTRY_BYTES;

const MAGIC: [u8; 8] = *b"SHDWKVIX";
const VERSION: u32 = 1;
const HEADER: u64 = 64;
const RECORD: u64 = 16;
/// More blocks than any sequence has (a record beyond is not ours).
const MAX_ORDINAL: usize = 4096;

/// The index a pool of `len` bytes needs.
pub fn index_bytes(len: u64) -> u64 {
    HEADER + RECORD * (len / BLOCK_BYTES as u64)
}

/// The key a sequence is known by in the index: its connection's name.
pub fn key_of(name: &str) -> u64 {
    let h = name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    });
    h.max(1)
}

/// A key for a sequence no connection in the store names (nobody goes on
/// with it): this engine's own, never 0 nor another's name.
pub fn private_key() -> u64 {
    static NEXT: AtomicU64 = AtomicU64::new(1);
    let n = NEXT.fetch_add(1, Ordering::Relaxed);
    key_of(&format!("private-{}-{n}", std::process::id()))
}

/// A `kv_pool` request on its way ([`Paged::ask`]).
pub struct Asked(gms::kvpool::Asked<HostRange>);

/// How long a stream waits for the wake's request for the pool to be made
/// (it is made before `READY=1`, so only a stream of an engine that was
/// never promoted could wait: none does); a gmsd that does not answer
/// costs the first stream this once, which then runs outside the pool.
pub const KV_WAIT: std::time::Duration = std::time::Duration::from_secs(2);

/// The pair's KV pool as this engine has it: asked for at the wake, its
/// answer taken by the first stream that needs it (new, or taken over), so
/// that the grant and the mapping never run beside a promotion's first
/// plain answers; then this engine's [`Paged`] cache, or none.
pub struct Pool {
    slot: String,
    taken: std::sync::OnceLock<Option<Paged>>,
    state: Mutex<Waiting>,
    changed: std::sync::Condvar,
}

#[derive(Default)]
struct Waiting {
    /// Set at the wake: the request (None: none was made).
    asked: Option<Option<Asked>>,
    /// The streams a takeover goes on with, once it sorted its jobs and
    /// before the pool was taken: the taker lets the rest go.
    going_on: Option<HashSet<u64>>,
}

impl Pool {
    pub fn new(slot: &str) -> Pool {
        Pool {
            slot: slot.to_owned(),
            taken: std::sync::OnceLock::new(),
            state: Mutex::new(Waiting::default()),
            changed: std::sync::Condvar::new(),
        }
    }

    /// The wake's request (or that none was made).
    pub fn asked(&self, asked: Option<Asked>) {
        lock(&self.state).asked = Some(asked);
        self.changed.notify_all();
    }

    /// The pool, if it was taken already (never waits).
    pub fn get(&self) -> Option<&Paged> {
        self.taken.get().and_then(Option::as_ref)
    }

    /// The pool, taking gmsd's answer if nobody did yet (one taker; the
    /// others wait for it); None without one.
    pub fn take(&self) -> Option<&Paged> {
        if let Some(p) = self.taken.get() {
            return p.as_ref();
        }
        let st = lock(&self.state);
        let mut st = self
            .changed
            .wait_timeout_while(st, KV_WAIT, |w| w.asked.is_none())
            .map(|(g, _)| g)
            .unwrap_or_else(|e| e.into_inner().0);
        if let Some(p) = self.taken.get() {
            return p.as_ref();
        }
        let paged = st.asked.take().flatten().and_then(|a| match Paged::granted(a) {
            Ok(p) => {
                println!(
                    "shadow-engine slot {} KV pool {:016x}: {} blocks of {} tokens, {} sequences carried{}; fence {}",
                    self.slot,
                    p.pool_id(),
                    p.blocks(),
                    BLOCK_TOKENS,
                    p.carried_sequences(),
                    p.fresh().map_or(String::new(), |w| format!(" ({w})")),
                    if p.fenced() { "passed" } else { "pending" }
                );
                let _ = std::io::Write::flush(&mut std::io::stdout());
                Some(p)
            }
            Err(e) => {
                eprintln!("shadow-engine: {e}: no KV is carried to the next engine");
                None
            }
        });
        if let (Some(p), Some(keys)) = (&paged, &st.going_on) {
            self.settled(p, keys);
        }
        let _ = self.taken.set(paged);
        drop(st);
        self.get()
    }

    /// A takeover sorted its jobs: these streams go on; what the pool
    /// holds of any other is let go, now or when the pool is taken.
    pub fn taken_over(&self, going_on: HashSet<u64>) {
        let mut st = lock(&self.state);
        match self.taken.get() {
            Some(Some(p)) => self.settled(p, &going_on),
            Some(None) => {}
            None => st.going_on = Some(going_on),
        }
    }

    fn settled(&self, p: &Paged, going_on: &HashSet<u64>) {
        let let_go = p.settle(going_on);
        if let_go > 0 {
            println!(
                "shadow-engine slot {} KV: {let_go} sequences no connection goes on with, let go",
                self.slot
            );
        }
    }
}

/// The paged KV cache of this engine, over the pair's pool.
pub struct Paged {
    pool: KvPool<HostRange>,
    blocks: u32,
    free: Mutex<Vec<u32>>,
    /// Blocks an earlier writer may still write: free once the fence passed.
    aside: Mutex<Vec<u32>>,
    /// The sequences the index named when this engine took the pool: by
    /// key, their blocks by ordinal; taken by [`Paged::resume`], the rest
    /// let go by [`Paged::settle`].
    carried: Mutex<HashMap<u64, Vec<Option<u32>>>>,
    fenced: AtomicBool,
    /// Why nothing was carried, when so ("a new pool", "another pool's
    /// index").
    fresh: Option<String>,
}

/// A block's record in the index.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Record {
    owner: u64,
    ordinal: u32,
}

impl Paged {
    /// Asks the gmsd at `socket` for the write lease of the pair's KV pool,
    /// showing `proof` (the descriptor this engine's lock holder holds the
    /// election lock through), `bytes` of it for a new pool; the proof may
    /// be closed once this returns. [`Paged::granted`] waits for the answer.
    pub fn ask(socket: &Path, proof: BorrowedFd<'_>, bytes: u64) -> Result<Asked, String> {
        let index_len = index_bytes(bytes).max(HEADER + RECORD);
        KvPool::ask(
            &HostMapper::default(),
            socket,
            proof,
            bytes,
            index_len,
            4096,
        )
        .map(Asked)
        .map_err(|e| format!("asking for the KV pool's write lease: {e}"))
    }

    /// The pool [`Paged::ask`] asked for, and what its index says was left
    /// in it.
    pub fn granted(asked: Asked) -> Result<Paged, String> {
        let pool = asked
            .0
            .granted(&HostMapper::default())
            .map_err(|e| format!("the KV pool's write lease: {e}"))?;
        let blocks = u32::try_from(pool.len() / BLOCK_BYTES as u64).unwrap_or(u32::MAX);
        let blocks = blocks.min(u32::try_from((pool.index_bytes() - HEADER) / RECORD).unwrap_or(0));
        let index = pool.index();
        let mut header = [0u8; HEADER as usize];
        index
            .read_exact_at(&mut header, 0)
            .map_err(|e| format!("reading the KV index: {e}"))?;
        let fresh = if pool.created() {
            Some("a new pool (gmsd made it now: nothing to carry)".to_owned())
        } else if header[..8] != MAGIC {
            Some("the pool's index was never written".to_owned())
        } else if header != header_for(pool.id(), blocks) {
            Some("the pool's index is another pool's or another geometry's".to_owned())
        } else {
            None
        };
        let mut free = Vec::new();
        let mut carried: HashMap<u64, Vec<Option<u32>>> = HashMap::new();
        // Records no sequence can have: let go below.
        let mut strays = Vec::new();
        if fresh.is_some() {
            // Every record cleared, then the header: an index is ours only
            // once it is whole.
            let zeros = vec![0u8; (RECORD * u64::from(blocks)) as usize];
            index
                .write_all_at(&zeros, HEADER)
                .and_then(|()| index.write_all_at(&header_for(pool.id(), blocks), 0))
                .map_err(|e| format!("writing the KV index: {e}"))?;
            free.extend((0..blocks).rev());
        } else {
            let mut records = vec![0u8; (RECORD * u64::from(blocks)) as usize];
            index
                .read_exact_at(&mut records, HEADER)
                .map_err(|e| format!("reading the KV index: {e}"))?;
            for (b, r) in records.chunks_exact(RECORD as usize).enumerate() {
                let owner = u64::from_le_bytes(r[..8].try_into().unwrap_or_default());
                let ordinal = u32::from_le_bytes(r[8..12].try_into().unwrap_or_default());
                let b = b as u32;
                if owner == 0 {
                    free.push(b);
                    continue;
                }
                let at = ordinal as usize;
                if at >= MAX_ORDINAL {
                    strays.push(b); // no sequence is that long
                    continue;
                }
                let blocks = carried.entry(owner).or_default();
                if blocks.len() <= at {
                    blocks.resize(at + 1, None);
                }
                // Two blocks of one ordinal: a copy of a tail and its
                // original, cut between their records; both hold the
                // committed entries. The second is let go.
                if blocks[at].is_some() {
                    strays.push(b);
                } else {
                    blocks[at] = Some(b);
                }
            }
            free.reverse();
        }
        let fenced = pool.fence().passed();
        let paged = Paged {
            pool,
            blocks,
            free: Mutex::new(free),
            aside: Mutex::new(Vec::new()),
            carried: Mutex::new(carried),
            fenced: AtomicBool::new(fenced),
            fresh,
        };
        for b in strays {
            paged.let_go(b);
        }
        Ok(paged)
    }

    pub fn pool_id(&self) -> u64 {
        self.pool.id()
    }

    pub fn blocks(&self) -> u32 {
        self.blocks
    }

    /// Sequences the index named when this engine took the pool, not yet
    /// gone on with or let go.
    pub fn carried_sequences(&self) -> usize {
        lock(&self.carried).len()
    }

    /// Why nothing was carried, if so.
    pub fn fresh(&self) -> Option<&str> {
        self.fresh.as_deref()
    }

    /// Whether every earlier writer of the pool is gone; once it is, the
    /// blocks kept aside are free.
    pub fn fenced(&self) -> bool {
        if self.fenced.load(Ordering::Acquire) {
            return true;
        }
        if !self.pool.fence().passed() {
            return false;
        }
        self.fenced.store(true, Ordering::Release);
        let aside = std::mem::take(&mut *lock(&self.aside));
        lock(&self.free).extend(aside);
        true
    }

    /// A new sequence, known by `key`.
    pub fn begin(&self, key: u64) -> Seq<'_> {
        Seq {
            paged: self,
            key,
            blocks: Vec::new(),
            lost: false,
        }
    }

    /// The sequence `key` the engine before this one left after `n`
    /// tokens: a decoder restored from its last entry, with nothing
    /// computed again, if the pool has every block of it; else a decoder
    /// that computed it again (and why). Its blocks are this engine's now;
    /// a partial tail is first copied to a fresh block if the fence has
    /// not passed.
    pub fn resume<'m>(
        &self,
        key: u64,
        n: usize,
        model: &'m Model,
        bytes: &'m [u8],
        prompt: &str,
        step: &mut dyn FnMut(),
    ) -> (Seq<'_>, Decoder<'m>, Option<String>) {
        let had = lock(&self.carried).remove(&key).unwrap_or_default();
        let need = n.div_ceil(BLOCK_TOKENS);
        let mut seq = self.begin(key);
        let whole = n > 0 && had.len() >= need && had[..need].iter().all(Option::is_some);
        let restored = if whole {
            let blocks: Vec<u32> = had[..need].iter().flatten().copied().collect();
            self.read_sequence(&blocks, n, model, bytes)
                .map(|d| (blocks, d))
        } else {
            None
        };
        let Some((blocks, decoder)) = restored else {
            let held = had_count(&had, need);
            for b in had.into_iter().flatten() {
                self.let_go(b);
            }
            let why = if n == 0 {
                None
            } else if let Some(fresh) = &self.fresh {
                Some(fresh.clone())
            } else if whole {
                Some("its entries in the pool are not the model's".to_owned())
            } else {
                Some(format!("the pool holds {held} of its {need} blocks"))
            };
            // Decoded again, step by step under the watchdog, each entry
            // back into the pool as it would have been.
            let mut decoder = model.start(bytes, prompt);
            for i in 0..n {
                decoder.next_token();
                step();
                seq.put(i, &decoder);
            }
            return (seq, decoder, why);
        };
        // Blocks beyond the committed tokens may be half written by the
        // engine before: let go.
        for b in had.into_iter().skip(need).flatten() {
            self.let_go(b);
        }
        seq.blocks = blocks;
        if n % BLOCK_TOKENS != 0 && !self.fenced() {
            seq.copy_tail(n % BLOCK_TOKENS);
        }
        (seq, decoder, None)
    }

    /// After a takeover: the sequences the index named that no connection
    /// goes on with are let go.
    pub fn settle(&self, going_on: &HashSet<u64>) -> usize {
        let gone: Vec<Vec<Option<u32>>> = {
            let mut carried = lock(&self.carried);
            let keys: Vec<u64> = carried
                .keys()
                .filter(|k| !going_on.contains(k))
                .copied()
                .collect();
            keys.iter().filter_map(|k| carried.remove(k)).collect()
        };
        let n = gone.len();
        for b in gone.into_iter().flatten().flatten() {
            self.let_go(b);
        }
        n
    }

    /// The decoder after the `n` tokens in `blocks`, read from the pool.
    fn read_sequence<'m>(
        &self,
        blocks: &[u32],
        n: usize,
        model: &'m Model,
        bytes: &'m [u8],
    ) -> Option<Decoder<'m>> {
        let mut words = Vec::with_capacity(n);
        let mut entry = vec![0u8; ENTRY_BYTES];
        let mut last = (Vec::new(), 0u64);
        for i in 0..n {
            let at = entry_offset(blocks[i / BLOCK_TOKENS], i % BLOCK_TOKENS);
            // Only the token's index of every entry; the whole entry of
            // the last one.
            if i + 1 < n {
                let mut tail = [0u8; 16];
                self.pool.read_at(at + (COLS * 4) as u64, &mut tail).ok()?;
                words.push(u32::from_le_bytes(tail[8..12].try_into().ok()?));
                continue;
            }
            self.pool.read_at(at, &mut entry).ok()?;
            let x: Vec<f32> = entry[..COLS * 4]
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect();
            let tail = &entry[COLS * 4..];
            let state = u64::from_le_bytes(tail[..8].try_into().ok()?);
            words.push(u32::from_le_bytes(tail[8..12].try_into().ok()?));
            last = (x, state);
        }
        model.restore(bytes, last.0, last.1, &words)
    }

    fn take_block(&self) -> Option<u32> {
        self.fenced(); // moves what was aside, once the fence passed
        lock(&self.free).pop()
    }

    /// A block no longer this engine's: its record cleared, then free, or
    /// aside until the fence.
    fn let_go(&self, block: u32) {
        self.write_record(
            block,
            Record {
                owner: 0,
                ordinal: 0,
            },
        );
        if self.fenced() {
            lock(&self.free).push(block);
        } else {
            lock(&self.aside).push(block);
        }
    }

    /// Gives a block this engine wrote back: its predecessor never wrote it
    /// after this engine took it, so it is free at once.
    fn give_back(&self, block: u32) {
        self.write_record(
            block,
            Record {
                owner: 0,
                ordinal: 0,
            },
        );
        lock(&self.free).push(block);
    }

    fn write_record(&self, block: u32, r: Record) -> bool {
        let mut bytes = [0u8; RECORD as usize];
        bytes[..8].copy_from_slice(&r.owner.to_le_bytes());
        bytes[8..12].copy_from_slice(&r.ordinal.to_le_bytes());
        let at = HEADER + RECORD * u64::from(block);
        match self.pool.index().write_all_at(&bytes, at) {
            Ok(()) => true,
            Err(e) => {
                eprintln!("shadow-engine: writing block {block}'s record in the KV index: {e}");
                false
            }
        }
    }
}

/// One sequence's blocks, in order; let go when dropped (the stream
/// ended, or its client went). An engine killed drops nothing: its
/// sequences stay in the index for the next.
pub struct Seq<'p> {
    paged: &'p Paged,
    key: u64,
    blocks: Vec<u32>,
    /// A block could not be had (the pool is full) or its record not
    /// written: the rest of this sequence is not in the pool, so it is not
    /// carried (the next engine computes it again).
    lost: bool,
}

impl Seq<'_> {
    /// Writes the entry of token `i` (0-based) from the decoder that just
    /// made it; a new block first when `i` starts one.
    pub fn put(&mut self, i: usize, d: &Decoder<'_>) {
        if self.lost {
            return;
        }
        let ordinal = i / BLOCK_TOKENS;
        if ordinal == self.blocks.len() {
            let Some(b) = self.paged.take_block() else {
                return self.lose("the KV pool is full");
            };
            let r = Record {
                owner: self.key,
                ordinal: ordinal as u32,
            };
            if !self.paged.write_record(b, r) {
                lock(&self.paged.free).push(b);
                return self.lose("its block's record could not be written");
            }
            self.blocks.push(b);
        } else if ordinal > self.blocks.len() {
            return self.lose("a token came before the one it follows");
        }
        let (x, state) = d.entry();
        let word = d
            .generated()
            .get(i)
            .and_then(|w| word_index(w))
            .unwrap_or(u32::MAX);
        let mut entry = vec![0u8; ENTRY_BYTES];
        for (c, v) in entry.chunks_exact_mut(4).zip(x) {
            c.copy_from_slice(&v.to_le_bytes());
        }
        entry[COLS * 4..COLS * 4 + 8].copy_from_slice(&state.to_le_bytes());
        entry[COLS * 4 + 8..COLS * 4 + 12].copy_from_slice(&word.to_le_bytes());
        let at = entry_offset(self.blocks[ordinal], i % BLOCK_TOKENS);
        if let Err(e) = self.paged.pool.write_at(at, &entry) {
            self.lose(&format!("writing its entry: {e}"));
        }
    }

    /// Before the fence: the first `filled` entries of the tail block go to
    /// a fresh block, whose record names the same ordinal; the old block is
    /// let go (kept aside).
    fn copy_tail(&mut self, filled: usize) {
        let Some(&old) = self.blocks.last() else {
            return;
        };
        let Some(new) = self.paged.take_block() else {
            return self.lose("the KV pool has no block to copy a tail into");
        };
        let mut buf = vec![0u8; filled * ENTRY_BYTES];
        let copied = self
            .paged
            .pool
            .read_at(entry_offset(old, 0), &mut buf)
            .and_then(|()| self.paged.pool.write_at(entry_offset(new, 0), &buf));
        let ordinal = (self.blocks.len() - 1) as u32;
        let r = Record {
            owner: self.key,
            ordinal,
        };
        if copied.is_err() || !self.paged.write_record(new, r) {
            lock(&self.paged.free).push(new);
            return self.lose("its tail could not be copied");
        }
        self.paged.let_go(old);
        if let Some(last) = self.blocks.last_mut() {
            *last = new;
        }
    }

    fn lose(&mut self, why: &str) {
        if !self.lost {
            eprintln!(
                "shadow-engine: a sequence's KV stops going to the pool: {why}; a takeover computes it again"
            );
        }
        // Its blocks stay named until the sequence ends, but a takeover
        // finds a gap and computes it again; nothing of it is misread.
        self.lost = true;
    }
}

impl Drop for Seq<'_> {
    fn drop(&mut self) {
        for b in self.blocks.drain(..) {
            self.paged.give_back(b);
        }
    }
}

fn entry_offset(block: u32, i: usize) -> u64 {
    u64::from(block) * BLOCK_BYTES as u64 + (i * ENTRY_BYTES) as u64
}

fn header_for(pool: u64, blocks: u32) -> [u8; HEADER as usize] {
    let mut h = [0u8; HEADER as usize];
    h[..8].copy_from_slice(&MAGIC);
    h[8..12].copy_from_slice(&VERSION.to_le_bytes());
    h[12..16].copy_from_slice(&(BLOCK_TOKENS as u32).to_le_bytes());
    h[16..24].copy_from_slice(&(BLOCK_BYTES as u64).to_le_bytes());
    h[24..32].copy_from_slice(&u64::from(blocks).to_le_bytes());
    h[32..40].copy_from_slice(&pool.to_le_bytes());
    h
}

fn had_count(had: &[Option<u32>], need: usize) -> usize {
    had.iter().take(need).flatten().count()
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}
