//! Continuity: what lets a connection, and the request on it, outlive the
//! engine that answers it (the pair's fd store, `shadow_engine_kit::fdstore`).
//!
//! Each accepted connection is stored with a memfd of its resume state,
//! both under one name. The state is this module's format: a fixed
//! header, then one record written once the request is known.
//!
//! ```text
//! offset size
//!  0      8   magic "SHDWCONN"
//!  8      4   version (1), little-endian like every field
//! 12      4   kind: 0 none yet, 1 plain answer, 2 stream
//! 16      8   request length: the request's bytes in the socket
//! 24      8   record length
//! 32      8   FNV-1a 64 of kind, request length and the record
//! 40      8   progress: phase << 56 | count (the one word that moves)
//! 48     16   zero
//! 64      …   record: a plain answer's whole response bytes; for a
//!             stream: created, prompt_tokens, max_tokens (u64 each), then
//!             id, model and prompt, each a u32 length and its bytes
//! ```
//!
//! The phases: `new` (nothing recorded: the request, if any, is still in
//! the socket), `recorded` (the record is in; the request may or may not
//! have been consumed; nothing written yet), `answering n` (a stream: at
//! most the bytes of its head and first `n` token events written; a plain
//! answer: some of its bytes written), `finishing n` (a stream's final
//! event and `[DONE]` may be partly written), `done`. The record and its
//! fields are written before the progress word leaves `new`, and that
//! word is always one 8-byte `pwrite` at a fixed offset: the kernel does
//! not deliver SIGKILL in the middle of such a write into one page of a
//! memfd, so a reader sees the old word or the new one, never a mix.
//! Which bytes of an answer reached the socket is not recorded: the
//! kernel counts them ([`bytes_written`]).

use std::fs::File;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::time::{Duration, Instant};

use nix::libc;
use shadow_engine::openai::StreamHead;
use shadow_engine_kit::fdstore::{self, Stored};

/// The first bytes of every state memfd.
pub const MAGIC: [u8; 8] = *b"SHDWCONN";
/// The format's version; another one is refused.
pub const VERSION: u32 = 1;
/// Bytes before the record.
pub const HEADER_LEN: usize = 64;
/// Where the fields written with the record start (kind .. hash).
const FIELDS_AT: usize = 12;
/// Where the progress word is.
const PROGRESS_AT: usize = 40;
/// The largest state read back: more is no state of ours.
pub const STATE_MAX: usize = 1 << 20;

const KIND_PLAIN: u32 = 1;
const KIND_STREAM: u32 = 2;

const COUNT_MASK: u64 = (1 << 56) - 1;

/// How far a connection's answer got.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Progress {
    /// Nothing recorded: the request is (still) in the socket.
    New,
    /// The answer is recorded, nothing of it written.
    Recorded,
    /// Writing: for a stream, at most its head and this many token events.
    Answering(u64),
    /// A stream of this many tokens is writing its final event and `[DONE]`.
    Finishing(u64),
    /// Everything written.
    Done,
}

impl Progress {
    fn word(self) -> u64 {
        let (phase, count) = match self {
            Progress::New => (0, 0),
            Progress::Recorded => (1, 0),
            Progress::Answering(n) => (2, n),
            Progress::Finishing(n) => (3, n),
            Progress::Done => (4, 0),
        };
        (phase << 56) | (count & COUNT_MASK)
    }

    fn from_word(w: u64) -> Option<Progress> {
        let count = w & COUNT_MASK;
        Some(match w >> 56 {
            0 if count == 0 => Progress::New,
            1 if count == 0 => Progress::Recorded,
            2 => Progress::Answering(count),
            3 => Progress::Finishing(count),
            4 if count == 0 => Progress::Done,
            _ => return None,
        })
    }
}

/// The answer a connection is owed, as recorded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Work {
    /// A whole answer: its bytes from the status line on.
    Plain(Vec<u8>),
    /// A streamed completion: the bytes are `openai::stream_bytes` of the
    /// head and the tokens `Model::resume` recomputes from the prompt.
    Stream {
        head: StreamHead,
        prompt: String,
        max_tokens: usize,
    },
}

/// A state read back.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Saved {
    pub progress: Progress,
    /// The request's bytes (head and body) in the socket, consumed once
    /// the answer is recorded.
    pub request_len: u64,
    /// None while [`Progress::New`].
    pub work: Option<Work>,
}

/// Why a memfd holds no state this engine can go on from.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Torn {
    #[error("{0} bytes, shorter than the {1} its header says")]
    Short(usize, usize),
    #[error("{0} bytes, more than any state")]
    Long(usize),
    #[error("not a connection state (magic)")]
    Magic,
    #[error("format version {0}, this engine reads {VERSION}")]
    Version(u32),
    #[error("unknown progress word {0:#x}")]
    Progress(u64),
    #[error("unknown kind {0}")]
    Kind(u32),
    #[error("the record's checksum does not match")]
    Checksum,
    #[error("the record is cut short at {0}")]
    Record(&'static str),
    #[error("{0}")]
    Inconsistent(String),
}

/// FNV-1a, 64 bits: enough to tell a record cut short or overwritten.
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for &b in *p {
            h ^= u64::from(b);
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
    }
    h
}

/// The header of a connection with nothing recorded yet.
pub fn new_header() -> [u8; HEADER_LEN] {
    let mut h = [0u8; HEADER_LEN];
    h[..8].copy_from_slice(&MAGIC);
    h[8..12].copy_from_slice(&VERSION.to_le_bytes());
    h[PROGRESS_AT..PROGRESS_AT + 8].copy_from_slice(&Progress::New.word().to_le_bytes());
    h
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u32).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

/// The record of `work` and the header fields that go with it (written at
/// [`FIELDS_AT`]: kind, request length, record length, checksum).
pub fn encode(request_len: u64, work: &Work) -> ([u8; PROGRESS_AT - FIELDS_AT], Vec<u8>) {
    let (kind, record) = match work {
        Work::Plain(bytes) => (KIND_PLAIN, bytes.clone()),
        Work::Stream {
            head,
            prompt,
            max_tokens,
        } => {
            let mut r = Vec::with_capacity(48 + head.id.len() + prompt.len());
            r.extend_from_slice(&head.created.to_le_bytes());
            r.extend_from_slice(&(head.prompt_tokens as u64).to_le_bytes());
            r.extend_from_slice(&(*max_tokens as u64).to_le_bytes());
            put_str(&mut r, &head.id);
            put_str(&mut r, &head.model);
            put_str(&mut r, prompt);
            (KIND_STREAM, r)
        }
    };
    let mut fields = [0u8; PROGRESS_AT - FIELDS_AT];
    fields[..4].copy_from_slice(&kind.to_le_bytes());
    fields[4..12].copy_from_slice(&request_len.to_le_bytes());
    fields[12..20].copy_from_slice(&(record.len() as u64).to_le_bytes());
    let sum = fnv1a(&[&kind.to_le_bytes(), &request_len.to_le_bytes(), &record]);
    fields[20..28].copy_from_slice(&sum.to_le_bytes());
    (fields, record)
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    let mut w = [0u8; 4];
    w.copy_from_slice(&b[at..at + 4]);
    u32::from_le_bytes(w)
}

fn u64_at(b: &[u8], at: usize) -> u64 {
    let mut w = [0u8; 8];
    w.copy_from_slice(&b[at..at + 8]);
    u64::from_le_bytes(w)
}

/// A cursor over a stream record.
struct Cursor<'a>(&'a [u8]);

impl<'a> Cursor<'a> {
    fn take(&mut self, n: usize, what: &'static str) -> Result<&'a [u8], Torn> {
        if self.0.len() < n {
            return Err(Torn::Record(what));
        }
        let (a, b) = self.0.split_at(n);
        self.0 = b;
        Ok(a)
    }

    fn u64(&mut self, what: &'static str) -> Result<u64, Torn> {
        Ok(u64_at(self.take(8, what)?, 0))
    }

    fn string(&mut self, what: &'static str) -> Result<String, Torn> {
        let n = u32_at(self.take(4, what)?, 0) as usize;
        let bytes = self.take(n, what)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| Torn::Record(what))
    }
}

/// Reads a state back: refuses anything short, torn, of another format, or
/// that contradicts itself.
pub fn decode(b: &[u8]) -> Result<Saved, Torn> {
    if b.len() < HEADER_LEN {
        return Err(Torn::Short(b.len(), HEADER_LEN));
    }
    if b.len() > STATE_MAX {
        return Err(Torn::Long(b.len()));
    }
    if b[..8] != MAGIC {
        return Err(Torn::Magic);
    }
    let version = u32_at(b, 8);
    if version != VERSION {
        return Err(Torn::Version(version));
    }
    let word = u64_at(b, PROGRESS_AT);
    let progress = Progress::from_word(word).ok_or(Torn::Progress(word))?;
    if progress == Progress::New {
        return Ok(Saved {
            progress,
            request_len: 0,
            work: None,
        });
    }
    let kind = u32_at(b, FIELDS_AT);
    let request_len = u64_at(b, FIELDS_AT + 4);
    let record_len = u64_at(b, FIELDS_AT + 12);
    let sum = u64_at(b, FIELDS_AT + 20);
    let end = usize::try_from(record_len)
        .ok()
        .and_then(|n| n.checked_add(HEADER_LEN))
        .filter(|end| *end <= b.len())
        .ok_or(Torn::Short(
            b.len(),
            HEADER_LEN.saturating_add(record_len as usize),
        ))?;
    let record = &b[HEADER_LEN..end];
    if fnv1a(&[&kind.to_le_bytes(), &request_len.to_le_bytes(), record]) != sum {
        return Err(Torn::Checksum);
    }
    let work = match kind {
        KIND_PLAIN => Work::Plain(record.to_vec()),
        KIND_STREAM => {
            let mut c = Cursor(record);
            let created = c.u64("created")?;
            let prompt_tokens = c.u64("prompt_tokens")? as usize;
            let max_tokens = c.u64("max_tokens")? as usize;
            let id = c.string("id")?;
            let model = c.string("model")?;
            let prompt = c.string("prompt")?;
            if !c.0.is_empty() {
                return Err(Torn::Inconsistent(format!(
                    "{} bytes after the stream record",
                    c.0.len()
                )));
            }
            Work::Stream {
                head: StreamHead {
                    id,
                    created,
                    model,
                    prompt_tokens,
                },
                prompt,
                max_tokens,
            }
        }
        k => return Err(Torn::Kind(k)),
    };
    match (&work, progress) {
        (Work::Plain(_), Progress::Finishing(_)) | (Work::Plain(_), Progress::Answering(1..)) => {
            return Err(Torn::Inconsistent(format!(
                "a plain answer at {progress:?}"
            )))
        }
        (Work::Stream { max_tokens, .. }, Progress::Answering(n) | Progress::Finishing(n))
            if n > *max_tokens as u64 =>
        {
            return Err(Torn::Inconsistent(format!(
                "{n} tokens of a stream of {max_tokens}"
            )))
        }
        _ => {}
    }
    Ok(Saved {
        progress,
        request_len,
        work: Some(work),
    })
}

/// A connection's state memfd, as this engine updates it.
#[derive(Debug)]
pub struct Track {
    /// The name the connection and the memfd are stored under.
    pub name: String,
    file: File,
}

impl Track {
    /// A new memfd holding the header of a connection with nothing
    /// recorded (close-on-exec: it is passed on by the store only).
    pub fn create(name: String) -> io::Result<Track> {
        let fd = nix::sys::memfd::memfd_create(
            "shadow-engine-conn",
            nix::sys::memfd::MFdFlags::MFD_CLOEXEC,
        )
        .map_err(io::Error::from)?;
        let file = File::from(fd);
        file.write_all_at(&new_header(), 0)?;
        Ok(Track { name, file })
    }

    /// A memfd fetched from the store, stored under `name`.
    pub fn fetched(name: String, file: File) -> Track {
        Track { name, file }
    }

    pub fn fd(&self) -> BorrowedFd<'_> {
        self.file.as_fd()
    }

    /// The state as it is now.
    pub fn read(&self) -> Result<Saved, Torn> {
        let len = self.file.metadata().map(|m| m.len()).unwrap_or(0);
        let len = usize::try_from(len).unwrap_or(usize::MAX);
        if len > STATE_MAX {
            return Err(Torn::Long(len));
        }
        let mut buf = vec![0u8; len];
        let mut got = 0;
        while got < len {
            match self.file.read_at(&mut buf[got..], got as u64) {
                Ok(0) => break,
                Ok(n) => got += n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(_) => break,
            }
        }
        buf.truncate(got);
        decode(&buf)
    }

    /// Records the answer owed (the record, then its fields, then the
    /// progress word: [`Progress::Recorded`]).
    pub fn record(&self, request_len: u64, work: &Work) -> io::Result<()> {
        let (fields, record) = encode(request_len, work);
        self.file.write_all_at(&record, HEADER_LEN as u64)?;
        self.file.write_all_at(&fields, FIELDS_AT as u64)?;
        self.set(Progress::Recorded)
    }

    /// Moves the progress word: one 8-byte `pwrite`.
    pub fn set(&self, p: Progress) -> io::Result<()> {
        let n = self
            .file
            .write_at(&p.word().to_le_bytes(), PROGRESS_AT as u64)?;
        if n != 8 {
            return Err(io::Error::new(
                io::ErrorKind::WriteZero,
                format!("{n} of the progress word's 8 bytes written"),
            ));
        }
        Ok(())
    }
}

/// A connection's entry in the store while this engine answers it: every
/// update goes to its [`Track`]; one that fails takes the entry out of the
/// store (a state that lags behind the bytes written must not be resumed)
/// and the answer goes on untracked.
#[derive(Debug)]
pub struct Link {
    track: Option<Track>,
    /// The runtime's name of a connection it handed over
    /// (`SHADOW_ACCEPT=runtime`): removed from the store once done,
    /// tracked or not, since the store's copy keeps the connection open.
    handed: Option<String>,
}

impl Link {
    pub fn new(track: Option<Track>) -> Link {
        Link {
            track,
            handed: None,
        }
    }

    /// A connection the runtime stored under `name` and handed over, with
    /// its state in a memfd stored under the same name (when `track`).
    pub fn handed(name: String, track: Option<Track>) -> Link {
        Link {
            track,
            handed: Some(name),
        }
    }

    /// A connection the runtime stored under `name` with no state yet
    /// (handed to an engine that died before it stored one): a fresh
    /// memfd, stored under that name.
    pub fn adopt(name: String) -> Link {
        let track = Track::create(name.clone()).ok().filter(|t| {
            fdstore::store(&[t.fd()], &t.name, false)
                .map_err(|e| eprintln!("shadow-engine: storing the state of {}: {e}", t.name))
                .is_ok()
        });
        Link::handed(name, track)
    }

    pub fn tracked(&self) -> bool {
        self.track.is_some()
    }

    /// The name the connection is stored under, if it is.
    pub fn name(&self) -> Option<&str> {
        self.track
            .as_ref()
            .map(|t| t.name.as_str())
            .or(self.handed.as_deref())
    }

    fn failed(&mut self, what: &str, e: &io::Error) {
        if let Some(t) = self.track.take() {
            self.handed = None;
            eprintln!(
                "shadow-engine: connection {}: {what}: {e}: no longer resumable",
                t.name
            );
            let _ = fdstore::remove(&t.name);
        }
    }

    pub fn record(&mut self, request_len: u64, work: &Work) {
        if let Some(Err(e)) = self.track.as_ref().map(|t| t.record(request_len, work)) {
            self.failed("recording its answer", &e);
        }
    }

    pub fn note(&mut self, p: Progress) {
        if let Some(Err(e)) = self.track.as_ref().map(|t| t.set(p)) {
            self.failed("recording its progress", &e);
        }
    }

    /// The answer is written: `done`, the write side shut (the client sees
    /// the end at once, whatever copies of the socket the store still
    /// holds), the entry removed from the store. The caller closes.
    pub fn finish(mut self, sock: BorrowedFd<'_>) {
        let track = self.track.take();
        let Some(name) = track
            .as_ref()
            .map(|t| t.name.clone())
            .or(self.handed.take())
        else {
            return;
        };
        if let Some(t) = &track {
            let _ = t.set(Progress::Done);
        }
        let _ = nix::sys::socket::shutdown(sock.as_raw_fd(), nix::sys::socket::Shutdown::Write);
        if let Err(e) = fdstore::remove(&name) {
            eprintln!("shadow-engine: removing {name} from the fd store: {e}");
        }
    }

    /// Gives up on the connection: out of the store, closed by the caller.
    pub fn drop_entry(mut self) {
        let name = self.track.take().map(|t| t.name).or(self.handed.take());
        if let Some(name) = name {
            let _ = fdstore::remove(&name);
        }
    }
}

/// Puts each accepted connection in the store with a fresh state memfd,
/// under a name no other engine of the pair uses: `conn-<slot>-<this
/// engine's start, µs>-<n>`. The memfd is made before the connection is
/// accepted, so that between the accept and the store holding the
/// connection there is only the send of the notify datagram.
#[derive(Debug)]
pub struct Keeper {
    prefix: String,
    next: u64,
    spare: Option<Track>,
    /// A failure was said already (once is enough).
    said: bool,
    /// After a failure, connections go unstored until then: a runtime
    /// that does not read its notify socket would make each store wait
    /// its whole timeout.
    pause_until: Option<Instant>,
}

/// How long storing pauses after a store failed.
const PAUSE: Duration = Duration::from_secs(5);

/// What every name this engine stores begins with (then `-<n>`).
pub fn own_prefix(slot: &str, boot_us: u128) -> String {
    format!("conn-{slot}-{boot_us}")
}

impl Keeper {
    pub fn new(slot: &str, boot_us: u128) -> Keeper {
        Keeper {
            prefix: own_prefix(slot, boot_us),
            next: 0,
            spare: None,
            said: false,
            pause_until: None,
        }
    }

    fn say(&mut self, what: String) {
        if !std::mem::replace(&mut self.said, true) {
            eprintln!(
                "shadow-engine: {what}: connections go without the fd store meanwhile (said once)"
            );
        }
    }

    /// A memfd for the next connection, made now if there is none.
    pub fn prepare(&mut self) {
        if self.spare.is_some() {
            return;
        }
        let name = format!("{}-{}", self.prefix, self.next);
        self.next += 1;
        match Track::create(name) {
            Ok(t) => self.spare = Some(t),
            Err(e) => self.say(format!("memfd_create: {e}")),
        }
    }

    /// Stores `conn` with its memfd (`[conn, memfd]`, one name); an
    /// untracked link when the store does not take it.
    pub fn keep(&mut self, conn: BorrowedFd<'_>) -> Link {
        if self.pause_until.is_some_and(|t| Instant::now() < t) {
            return Link::new(None);
        }
        self.prepare();
        let Some(track) = self.spare.take() else {
            return Link::new(None);
        };
        // FDPOLL=0: this engine removes every connection itself once it
        // is done with it, so the shim need not watch them for a hang-up
        // (two epoll_ctl and a wake-up per connection saved); one whose
        // engine died first is closed by the engine that fetches it.
        match fdstore::store(&[conn, track.fd()], &track.name, false) {
            Ok(()) => Link::new(Some(track)),
            Err(e) => {
                self.say(format!("storing {}: {e}", track.name));
                self.pause_until = Some(Instant::now() + PAUSE);
                // Nothing was stored: the memfd serves the next one.
                self.spare = Some(track);
                Link::new(None)
            }
        }
    }
}

impl Keeper {
    /// A connection the runtime handed over under `name`: this engine's
    /// state memfd is stored under the same name (the connection is in the
    /// store already).
    pub fn keep_handed(&mut self, name: String) -> Link {
        if self.pause_until.is_some_and(|t| Instant::now() < t) {
            return Link::handed(name, None);
        }
        self.prepare();
        let Some(mut track) = self.spare.take() else {
            return Link::handed(name, None);
        };
        track.name = name.clone();
        match fdstore::store(&[track.fd()], &name, false) {
            Ok(()) => Link::handed(name, Some(track)),
            Err(e) => {
                self.say(format!("storing the state of {name}: {e}"));
                self.pause_until = Some(Instant::now() + PAUSE);
                self.spare = Some(track);
                Link::handed(name, None)
            }
        }
    }
}

/// How many bytes the dead engine (and everyone else) wrote to an
/// accepted TCP socket: the contract's count (`TCP_INFO` and `SIOCOUTQ`).
pub use shadow_engine_kit::tcp::bytes_written;

/// One name of the store, as fetched: a connection and its state, when
/// it has exactly one of each.
#[derive(Debug)]
pub struct Entry {
    pub name: String,
    pub socket: Option<OwnedFd>,
    pub state: Option<File>,
    /// Descriptors beyond one socket and one memfd (closed).
    pub odd: usize,
}

/// Groups what a fetch gave by name (in the order first seen), by kind.
pub fn group(stored: Vec<Stored>) -> Vec<Entry> {
    let mut out: Vec<Entry> = Vec::new();
    for s in stored {
        let i = match out.iter().position(|e| e.name == s.name) {
            Some(i) => i,
            None => {
                out.push(Entry {
                    name: s.name.clone(),
                    socket: None,
                    state: None,
                    odd: 0,
                });
                out.len() - 1
            }
        };
        let e = &mut out[i];
        let mode = nix::sys::stat::fstat(s.fd.as_fd())
            .map(|st| st.st_mode & libc::S_IFMT)
            .unwrap_or(0);
        match mode {
            libc::S_IFSOCK if e.socket.is_none() => e.socket = Some(s.fd),
            libc::S_IFREG if e.state.is_none() => e.state = Some(File::from(s.fd)),
            _ => e.odd += 1,
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn head() -> StreamHead {
        StreamHead {
            id: "cmpl-0123456789abcdef".into(),
            created: 1_700_000_123,
            model: "shadow-reference".into(),
            prompt_tokens: 11,
        }
    }

    fn stream() -> Work {
        Work::Stream {
            head: head(),
            prompt: "a prompt ✓".into(),
            max_tokens: 256,
        }
    }

    /// The bytes of a state: the header, then `work` recorded at `p`.
    fn bytes(work: Option<&Work>, request_len: u64, p: Progress) -> Vec<u8> {
        let mut b = new_header().to_vec();
        if let Some(w) = work {
            let (fields, record) = encode(request_len, w);
            b[FIELDS_AT..PROGRESS_AT].copy_from_slice(&fields);
            b.extend(record);
        }
        b[PROGRESS_AT..PROGRESS_AT + 8].copy_from_slice(&p.word().to_le_bytes());
        b
    }

    #[test]
    fn states_round_trip_through_a_memfd() {
        let t = Track::create("conn-0-1-2".into()).unwrap();
        assert_eq!(
            t.read(),
            Ok(Saved {
                progress: Progress::New,
                request_len: 0,
                work: None
            })
        );
        let plain = Work::Plain(b"HTTP/1.1 200 OK\r\n\r\n{\"x\":1}".to_vec());
        for (work, request_len) in [(stream(), 180u64), (plain, 97)] {
            let t = Track::create("conn-0-1-3".into()).unwrap();
            t.record(request_len, &work).unwrap();
            let mut want = Saved {
                progress: Progress::Recorded,
                request_len,
                work: Some(work.clone()),
            };
            assert_eq!(t.read(), Ok(want.clone()));
            let steps: &[Progress] = if matches!(work, Work::Stream { .. }) {
                &[
                    Progress::Answering(0),
                    Progress::Answering(1),
                    Progress::Answering(256),
                    Progress::Finishing(256),
                    Progress::Done,
                ]
            } else {
                &[Progress::Answering(0), Progress::Done]
            };
            for &p in steps {
                t.set(p).unwrap();
                want.progress = p;
                assert_eq!(t.read(), Ok(want.clone()), "{p:?}");
            }
        }
        for p in [
            Progress::New,
            Progress::Recorded,
            Progress::Answering(7),
            Progress::Finishing(COUNT_MASK),
            Progress::Done,
        ] {
            assert_eq!(Progress::from_word(p.word()), Some(p));
        }
    }

    #[test]
    fn torn_short_or_foreign_states_are_refused() {
        let good = bytes(Some(&stream()), 180, Progress::Answering(3));
        assert!(decode(&good).is_ok());
        // Cut anywhere: refused, never a panic.
        for n in 0..good.len() {
            assert!(decode(&good[..n]).is_err(), "cut at {n}");
        }
        assert_eq!(decode(&[]), Err(Torn::Short(0, HEADER_LEN)));
        assert_eq!(decode(&good[..40]), Err(Torn::Short(40, HEADER_LEN)));
        let mut b = good.clone();
        b[0] ^= 1;
        assert_eq!(decode(&b), Err(Torn::Magic));
        let mut b = good.clone();
        b[8] = 2;
        assert_eq!(decode(&b), Err(Torn::Version(2)));
        // A byte of the record overwritten, or one of the fields.
        let mut b = good.clone();
        b[HEADER_LEN + 30] ^= 0x20;
        assert_eq!(decode(&b), Err(Torn::Checksum));
        let mut b = good.clone();
        b[FIELDS_AT + 4] ^= 1;
        assert_eq!(decode(&b), Err(Torn::Checksum));
        // A record length beyond the memfd.
        let mut b = good.clone();
        b[FIELDS_AT + 12..FIELDS_AT + 20].copy_from_slice(&u64::MAX.to_le_bytes());
        assert!(matches!(decode(&b), Err(Torn::Short(..))));
        // Progress words of no phase.
        for w in [5u64 << 56, (1 << 56) | 1, (4 << 56) | 9, u64::MAX] {
            let mut b = good.clone();
            b[PROGRESS_AT..PROGRESS_AT + 8].copy_from_slice(&w.to_le_bytes());
            assert_eq!(decode(&b), Err(Torn::Progress(w)), "{w:#x}");
        }
        // Recorded with no kind (the fields never written).
        let mut b = new_header().to_vec();
        b[PROGRESS_AT..PROGRESS_AT + 8].copy_from_slice(&Progress::Recorded.word().to_le_bytes());
        assert!(decode(&b).is_err());
        // States that contradict themselves.
        let over = bytes(Some(&stream()), 1, Progress::Answering(257));
        assert!(matches!(decode(&over), Err(Torn::Inconsistent(_))));
        let plain = Work::Plain(b"x".to_vec());
        for p in [Progress::Finishing(0), Progress::Answering(2)] {
            let odd = bytes(Some(&plain), 1, p);
            assert!(matches!(decode(&odd), Err(Torn::Inconsistent(_))), "{p:?}");
        }
        assert!(decode(&vec![0u8; STATE_MAX + 1]).is_err());
        // A memfd of the wrong contents reads as refused too.
        let t = Track::create("conn-x".into()).unwrap();
        t.file.set_len(10).unwrap();
        assert_eq!(t.read(), Err(Torn::Short(10, HEADER_LEN)));
    }

    #[test]
    fn fetched_descriptors_group_by_name_and_kind() {
        let (a, b) = std::os::unix::net::UnixStream::pair().unwrap();
        let m1 = Track::create("n".into()).unwrap();
        let m2 = Track::create("n".into()).unwrap();
        let m3 = Track::create("n".into()).unwrap();
        let st = |name: &str, fd: OwnedFd| Stored {
            name: name.into(),
            fd,
        };
        let g = group(vec![
            st("conn-1", OwnedFd::from(a)),
            st("conn-2", m1.file.as_fd().try_clone_to_owned().unwrap()),
            st("conn-1", m2.file.as_fd().try_clone_to_owned().unwrap()),
            st("conn-2", m3.file.as_fd().try_clone_to_owned().unwrap()),
            st("conn-3", OwnedFd::from(b)),
        ]);
        let seen: Vec<(&str, bool, bool, usize)> = g
            .iter()
            .map(|e| {
                (
                    e.name.as_str(),
                    e.socket.is_some(),
                    e.state.is_some(),
                    e.odd,
                )
            })
            .collect();
        assert_eq!(
            seen,
            [
                ("conn-1", true, true, 0),
                ("conn-2", false, true, 1),
                ("conn-3", true, false, 0)
            ]
        );
    }
}
