//! The pair's file-descriptor store: systemd's (`FDSTORE=1`, `FDNAME=`,
//! `FDSTOREREMOVE=1`, `FDPOLL=0`; `FileDescriptorStoreMax=` is
//! `shadow.dev/fdstore-max`) kept by the shim for a pair, so that what an
//! engine stores outlives it: a client's connection, a memfd of the state
//! needed to resume its request. The engine that takes over fetches the
//! store (`fetch.rs`); every engine started gets it in `LISTEN_FDS`.
//!
//! Engines are untrusted, so the store never reads, writes or waits on what
//! it holds: it keeps sockets and memfds only (anything else is refused and
//! closed), at most its bound, each under a valid name; it watches the
//! sockets for a hang-up (`EPOLLHUP`/`EPOLLERR` on an epoll of its own, so
//! data arriving for an engine never wakes the shim) and drops those, as
//! systemd does unless `FDPOLL=0`; and every close happens on the closer
//! thread, since the last close of a socket can block. Its own copies are
//! closed plainly (`Close::Release`): a connection whose engine closed it
//! first must still send what that engine wrote.
//!
//! By job: this module is the store as systemd's protocol has it (store,
//! remove, bound, names, copies for a start or a fetch, figures);
//! `accepted` keeps the connections the runtime accepts and whom each was
//! handed to. It has one owner, the pair's keeper task (`keeper.rs`),
//! which carries out every change, watches the hang-ups and publishes
//! the figures ([`Figures`]).

use std::collections::{BTreeMap, HashMap};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};
use serde::Serialize;
use shadow_contract::fdstore::{name_is_valid, DEFAULT_NAME};
use shadow_contract::state::FdStoreStatus;

use super::notify::release_now;
use crate::error::{Error, Result};

pub mod accepted;

/// Why descriptors sent to the store were not kept (each is counted).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Refused {
    /// Neither a socket nor a memfd.
    WrongType,
    /// The store held its bound (`shadow.dev/fdstore-max`).
    Full,
    /// `FDNAME=` is not a name systemd allows.
    BadName,
}

impl Refused {
    pub const ALL: [Refused; 3] = [Refused::WrongType, Refused::Full, Refused::BadName];

    /// Its place in [`Refused::ALL`].
    fn index(self) -> usize {
        match self {
            Refused::WrongType => 0,
            Refused::Full => 1,
            Refused::BadName => 2,
        }
    }

    /// The `reason` label of `shadow_fdstore_refused_total`.
    pub fn label(self) -> &'static str {
        match self {
            Refused::WrongType => "wrong_type",
            Refused::Full => "full",
            Refused::BadName => "bad_name",
        }
    }
}

/// What the store holds and did since the pair started, for state.json
/// and the metrics. Written by the store's one owner (the keeper task,
/// `keeper.rs`), read by the supervisor's publisher without a lock: each
/// figure is a counter of its own, and `moved` says one changed since the
/// publisher last looked.
#[derive(Debug, Default)]
pub struct Figures {
    /// The bound (`shadow.dev/fdstore-max`).
    max: u64,
    /// Descriptors held now.
    fds: AtomicU64,
    /// Descriptors kept.
    stored: AtomicU64,
    /// Dropped by `FDSTOREREMOVE=1`.
    removed: AtomicU64,
    /// Dropped because their peer hung up.
    hung_up: AtomicU64,
    /// Handed out by fetches.
    fetched: AtomicU64,
    /// Fetches answered.
    fetches: AtomicU64,
    /// Fetches refused (not the lock holder, not the slot's engine, busy).
    fetches_refused: AtomicU64,
    /// Not kept, by reason (in the order of [`Refused::ALL`]).
    refused: [AtomicU64; 3],
    /// Connections the runtime accepted (`shadow.dev/accept: runtime`).
    accepted: AtomicU64,
    /// Of those, handed to a serving engine through its hand-off socket.
    handed: AtomicU64,
    moved: AtomicBool,
}

fn add(counter: &AtomicU64, n: u64) {
    counter.fetch_add(n, Ordering::Relaxed);
}

impl Figures {
    /// What the store holds and did, as state.json and the metrics say it
    /// (every reason of refusal, 0 included).
    pub fn status(&self) -> FdStoreStatus {
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        FdStoreStatus {
            fds: get(&self.fds),
            max: self.max,
            stored: get(&self.stored),
            removed: get(&self.removed),
            hung_up: get(&self.hung_up),
            fetched: get(&self.fetched),
            fetches: get(&self.fetches),
            fetches_refused: get(&self.fetches_refused),
            accepted: get(&self.accepted),
            handed: get(&self.handed),
            refused: Refused::ALL
                .iter()
                .map(|r| (r.label().to_string(), get(&self.refused[r.index()])))
                .collect(),
        }
    }

    /// Whether a figure changed since the last [`Figures::take_moved`].
    pub fn moved(&self) -> bool {
        self.moved.load(Ordering::Acquire)
    }

    /// Whether a figure changed since the last look, which this is.
    pub fn take_moved(&self) -> bool {
        self.moved.swap(false, Ordering::AcqRel)
    }

    /// Records a change: true when it is the first since the publisher
    /// last looked.
    fn touch(&self) -> bool {
        !self.moved.swap(true, Ordering::AcqRel)
    }
}

/// One engine as a recipient of connections: its slot and the serial of
/// its hand-off sockets (a respawn of the slot is another recipient); who
/// it is, `shadow_pair::Connections` decides.
pub use shadow_pair::Recipient;

/// One stored descriptor.
#[derive(Debug)]
struct Entry {
    name: String,
    fd: OwnedFd,
    /// Registered on the epoll (a socket stored without `FDPOLL=0`).
    polled: bool,
}

/// What one store datagram did.
#[derive(Debug, Default)]
pub struct Stored {
    pub kept: usize,
    /// The descriptors not kept, to close (and why, for the log).
    pub refused: Vec<OwnedFd>,
    pub why: Option<Refused>,
}

/// The store of one pair; see the module doc.
#[derive(Debug)]
pub struct FdStore {
    max: usize,
    /// By token: the order stored (a fetch hands them out in it).
    entries: BTreeMap<u64, Entry>,
    /// The tokens stored under each name: a remove finds its entries
    /// without a walk over the whole store (a busy engine removes one per
    /// connection, with hundreds stored).
    by_name: HashMap<String, Vec<u64>>,
    next_token: u64,
    epoll: Epoll,
    figures: Arc<Figures>,
    /// A figure moved for the first time since the publisher looked: the
    /// supervisor is to hear of it ([`FdStore::take_nudge`]).
    nudge: bool,
    /// The names of the connections the runtime accepted, and the engine
    /// each was handed to (through its socket or a fetch), if any yet.
    accepted: HashMap<String, Option<Recipient>>,
}

/// What a descriptor is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Socket,
    Memfd,
    Other,
}

/// A socket by its mode; a memfd by its link in our own `/proc/self/fd`
/// (`/memfd:<name> (deleted)`) and no links on disk. Reads only the
/// shim's own procfs: no path an engine can write.
pub fn kind_of(fd: BorrowedFd<'_>) -> Kind {
    let Ok(st) = nix::sys::stat::fstat(fd) else {
        return Kind::Other;
    };
    match st.st_mode & libc::S_IFMT {
        libc::S_IFSOCK => Kind::Socket,
        libc::S_IFREG if st.st_nlink == 0 => {
            let link = std::fs::read_link(format!("/proc/self/fd/{}", fd.as_raw_fd()));
            match link {
                Ok(l) if l.as_os_str().as_encoded_bytes().starts_with(b"/memfd:") => Kind::Memfd,
                _ => Kind::Other,
            }
        }
        _ => Kind::Other,
    }
}

/// The `FDNAME=` and `FDPOLL=` of a datagram's text; `None` for a name
/// systemd would not take.
fn name_and_poll(text: &[u8]) -> (Option<String>, bool) {
    let mut name = Some(DEFAULT_NAME.to_string());
    let mut poll = true;
    for line in text.split(|b| *b == b'\n') {
        if let Some(v) = line.strip_prefix(b"FDNAME=") {
            name = std::str::from_utf8(v)
                .ok()
                .filter(|n| name_is_valid(n))
                .map(str::to_string);
        } else if line == b"FDPOLL=0" {
            poll = false;
        }
    }
    (name, poll)
}

impl FdStore {
    /// An empty store that keeps at most `max` descriptors.
    pub fn new(max: usize) -> Result<FdStore> {
        let epoll = Epoll::new(EpollCreateFlags::EPOLL_CLOEXEC)
            .map_err(|e| Error::sys("epoll_create1 for the fd store", e))?;
        Ok(FdStore {
            max,
            entries: BTreeMap::new(),
            by_name: HashMap::new(),
            next_token: 0,
            epoll,
            figures: Arc::new(Figures {
                max: max as u64,
                ..Figures::default()
            }),
            nudge: false,
            accepted: HashMap::new(),
        })
    }

    /// Its figures, as the publisher reads them.
    pub fn figures(&self) -> Arc<Figures> {
        self.figures.clone()
    }

    /// What the store holds and did (its figures now).
    #[cfg(test)]
    pub fn status(&self) -> FdStoreStatus {
        self.figures.status()
    }

    /// Records a change of the figures (the count held with it).
    fn moved(&mut self) {
        self.figures
            .fds
            .store(self.entries.len() as u64, Ordering::Relaxed);
        if self.figures.touch() {
            self.nudge = true;
        }
    }

    /// Whether the supervisor is to hear that the figures moved (the first
    /// move since its publisher last looked), once.
    pub fn take_nudge(&mut self) -> bool {
        std::mem::take(&mut self.nudge)
    }

    fn refuse(&mut self, why: Refused, n: usize) {
        add(&self.figures.refused[why.index()], n as u64);
    }

    /// `FDSTORE=1` with `fds`: keeps each socket and memfd while there is
    /// room, under the datagram's `FDNAME=` (all of a datagram's
    /// descriptors share its name, as systemd has it).
    pub fn store(&mut self, text: &[u8], fds: Vec<OwnedFd>) -> Stored {
        let (name, poll) = name_and_poll(text);
        let mut out = Stored::default();
        let Some(name) = name else {
            self.refuse(Refused::BadName, fds.len());
            self.moved();
            out.why = Some(Refused::BadName);
            out.refused = fds;
            return out;
        };
        for fd in fds {
            // The bound first: a full store costs a flood no fstat.
            let (kind, why) = if self.entries.len() >= self.max {
                (Kind::Other, Some(Refused::Full))
            } else {
                match kind_of(fd.as_fd()) {
                    Kind::Other => (Kind::Other, Some(Refused::WrongType)),
                    k => (k, None),
                }
            };
            if let Some(why) = why {
                self.refuse(why, 1);
                out.why = Some(why);
                out.refused.push(fd);
                continue;
            }
            let token = self.next_token;
            self.next_token += 1;
            // Hang-ups only: epoll always reports EPOLLHUP and EPOLLERR,
            // and asks for nothing else here (no EPOLLIN: the engine's
            // traffic never wakes the shim). A memfd cannot be polled.
            let polled = poll
                && kind == Kind::Socket
                && self
                    .epoll
                    .add(&fd, EpollEvent::new(EpollFlags::empty(), token))
                    .is_ok();
            self.by_name.entry(name.clone()).or_default().push(token);
            self.entries.insert(
                token,
                Entry {
                    name: name.clone(),
                    fd,
                    polled,
                },
            );
            add(&self.figures.stored, 1);
            out.kept += 1;
        }
        self.moved();
        out
    }

    /// Takes the entry of `token` out (its name's list too): its
    /// descriptor, to close.
    fn take_token(&mut self, token: u64) -> Option<OwnedFd> {
        let e = self.entries.remove(&token)?;
        if let Some(tokens) = self.by_name.get_mut(&e.name) {
            tokens.retain(|t| *t != token);
            if tokens.is_empty() {
                self.by_name.remove(&e.name);
                self.accepted.remove(&e.name);
            }
        }
        Some(unwatch(&self.epoll, e))
    }

    /// `FDSTOREREMOVE=1`: the descriptors stored under the datagram's
    /// `FDNAME=`, to close.
    pub fn remove(&mut self, text: &[u8]) -> Vec<OwnedFd> {
        let (Some(name), _) = name_and_poll(text) else {
            return Vec::new();
        };
        let tokens = self.by_name.remove(&name).unwrap_or_default();
        self.accepted.remove(&name);
        let (entries, epoll) = (&mut self.entries, &self.epoll);
        let gone: Vec<OwnedFd> = tokens
            .into_iter()
            .filter_map(|t| entries.remove(&t))
            .map(|e| unwatch(epoll, e))
            .collect();
        add(&self.figures.removed, gone.len() as u64);
        self.moved();
        gone
    }

    /// The sockets whose peer hung up since the last call, to close.
    pub fn hung_up(&mut self) -> Vec<OwnedFd> {
        let mut gone = Vec::new();
        let mut events = [EpollEvent::empty(); 256];
        // Level-triggered: a hung-up socket is reported until it is taken
        // off, so each full batch is taken before looking again.
        while let Ok(n) = self.epoll.wait(&mut events, EpollTimeout::ZERO) {
            if n == 0 {
                break;
            }
            let tokens: Vec<u64> = events[..n].iter().map(EpollEvent::data).collect();
            gone.extend(self.take_tokens(&tokens));
            if n < events.len() {
                break;
            }
        }
        gone
    }

    fn take_tokens(&mut self, tokens: &[u64]) -> Vec<OwnedFd> {
        if tokens.is_empty() {
            return Vec::new();
        }
        let gone: Vec<OwnedFd> = tokens.iter().filter_map(|t| self.take_token(*t)).collect();
        if !gone.is_empty() {
            add(&self.figures.hung_up, gone.len() as u64);
            self.moved();
        }
        gone
    }

    /// A copy of every descriptor, with its name, in the order stored: for
    /// a fetch or an engine's start. A copy that cannot be made (out of
    /// descriptors) is left out, and said.
    pub fn copies(&self) -> Vec<(String, OwnedFd)> {
        self.copies_but(|_| false)
    }

    /// [`FdStore::copies`] of every entry whose name `skip` does not take.
    fn copies_but(&self, skip: impl Fn(&str) -> bool) -> Vec<(String, OwnedFd)> {
        let mut out = Vec::with_capacity(self.entries.len());
        for e in self.entries.values().filter(|e| !skip(&e.name)) {
            match e.fd.try_clone() {
                Ok(fd) => out.push((e.name.clone(), fd)),
                Err(err) => log::warn!("fd store: copying {:?}: {err}", e.name),
            }
        }
        out
    }

    /// Whether one more descriptor fits.
    pub fn has_room(&self) -> bool {
        self.entries.len() < self.max
    }

    /// A fetch was answered with `n` descriptors.
    pub fn fetched(&mut self, n: usize) {
        add(&self.figures.fetches, 1);
        add(&self.figures.fetched, n as u64);
        self.moved();
    }

    pub fn fetch_refused(&mut self) {
        add(&self.figures.fetches_refused, 1);
        self.moved();
    }

    /// The epoll's descriptor (readable when a stored socket hung up).
    pub(crate) fn epoll_fd(&self) -> BorrowedFd<'_> {
        self.epoll.0.as_fd()
    }
}

/// An entry's descriptor, taken off the hang-up watch first: the
/// registration belongs to the open file, which the engines' copies keep
/// alive after the shim's is closed.
fn unwatch(epoll: &Epoll, e: Entry) -> OwnedFd {
    if e.polled {
        let _ = epoll.delete(&e.fd);
    }
    e.fd
}

impl Drop for FdStore {
    fn drop(&mut self) {
        self.by_name.clear();
        let all: Vec<OwnedFd> = std::mem::take(&mut self.entries)
            .into_values()
            .map(|e| unwatch(&self.epoll, e))
            .collect();
        release_now(all);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::net::{TcpListener, TcpStream};

    fn memfd(name: &str) -> OwnedFd {
        nix::sys::memfd::memfd_create(name, nix::sys::memfd::MFdFlags::MFD_CLOEXEC).unwrap()
    }

    fn tcp_pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        (s, c)
    }

    /// Connections the runtime accepted: handed once, never to the same
    /// engine again by its fetch, passed on whole to the engine that
    /// fetches next, and out of the store (name and all) by a remove.
    #[test]
    fn sockets_and_memfds_are_kept_and_nothing_else() {
        let d = tempfile::tempdir().unwrap();
        let file = std::fs::File::create(d.path().join("f")).unwrap();
        let (s, _c) = tcp_pair();
        let (r, _w) = nix::unistd::pipe().unwrap();
        assert_eq!(kind_of(s.as_fd()), Kind::Socket);
        assert_eq!(kind_of(memfd("state").as_fd()), Kind::Memfd);
        assert_eq!(kind_of(file.as_fd()), Kind::Other);
        assert_eq!(kind_of(r.as_fd()), Kind::Other);
        // A deleted file of a memfd's name is no memfd: its link says where.
        let path = d.path().join("memfd:x");
        let f = std::fs::File::create(&path).unwrap();
        std::fs::remove_file(&path).unwrap();
        assert_eq!(kind_of(f.as_fd()), Kind::Other);

        let mut st = FdStore::new(8).unwrap();
        let out = st.store(
            b"FDSTORE=1\nFDNAME=conn-1\n",
            vec![OwnedFd::from(s), memfd("m"), OwnedFd::from(file), r],
        );
        assert_eq!((out.kept, out.refused.len()), (2, 2));
        assert_eq!(out.why, Some(Refused::WrongType));
        assert_eq!(st.status().fds, 2);
        let names: Vec<String> = st.copies().into_iter().map(|(n, _)| n).collect();
        assert_eq!(names, ["conn-1", "conn-1"]);
        assert_eq!(st.status().refused["wrong_type"], 2);
    }

    #[test]
    fn the_bound_and_names_are_kept_to() {
        let mut st = FdStore::new(2).unwrap();
        let out = st.store(b"FDSTORE=1\n", vec![memfd("a"), memfd("b"), memfd("c")]);
        assert_eq!((out.kept, out.why), (2, Some(Refused::Full)));
        let names: Vec<String> = st.copies().into_iter().map(|(n, _)| n).collect();
        assert_eq!(
            names,
            [DEFAULT_NAME, DEFAULT_NAME],
            "systemd's default name"
        );
        for bad in [&b"FDSTORE=1\nFDNAME=a:b\n"[..], b"FDSTORE=1\nFDNAME=\n"] {
            let out = st.store(bad, vec![memfd("x")]);
            assert_eq!((out.kept, out.why), (0, Some(Refused::BadName)));
        }
        assert_eq!(st.remove(b"FDSTOREREMOVE=1\nFDNAME=stored\n").len(), 2);
        assert_eq!(st.status().fds, 0);
        assert_eq!(st.status().removed, 2);
    }

    /// A remove drops every descriptor of its name, from any datagram,
    /// and nothing else; what is left keeps the order it was stored in.
    #[test]
    fn a_remove_takes_its_name_only_and_the_order_stays() {
        let mut st = FdStore::new(16).unwrap();
        for name in ["a", "b", "a", "c", "b"] {
            let text = format!("FDSTORE=1\nFDNAME={name}\n");
            assert_eq!(
                st.store(text.as_bytes(), vec![memfd(name), memfd(name)])
                    .kept,
                2
            );
        }
        assert_eq!(st.remove(b"FDSTOREREMOVE=1\nFDNAME=b\n").len(), 4);
        assert!(
            st.remove(b"FDSTOREREMOVE=1\nFDNAME=b\n").is_empty(),
            "gone already"
        );
        assert!(st.remove(b"FDSTOREREMOVE=1\nFDNAME=zz\n").is_empty());
        let names: Vec<String> = st.copies().into_iter().map(|(n, _)| n).collect();
        assert_eq!(names, ["a", "a", "a", "a", "c", "c"]);
        assert_eq!(st.remove(b"FDSTOREREMOVE=1\nFDNAME=a\n").len(), 4);
        let names: Vec<String> = st.copies().into_iter().map(|(n, _)| n).collect();
        assert_eq!(names, ["c", "c"]);
        assert_eq!((st.status().fds, st.status().removed), (2, 8));
        // Room again for what the bound refused before.
        assert_eq!(st.store(b"FDSTORE=1\nFDNAME=d\n", vec![memfd("d")]).kept, 1);
    }

    /// A socket whose peer hung up is dropped (unless FDPOLL=0); one whose
    /// peer only sent data is not, and data never shows as an event.
    #[test]
    fn hung_up_sockets_are_dropped_unless_fdpoll_is_off() {
        let mut st = FdStore::new(16).unwrap();
        let (s1, mut c1) = tcp_pair();
        let (s2, c2) = tcp_pair();
        let (s3, c3) = tcp_pair();
        st.store(
            b"FDSTORE=1\nFDNAME=one\n",
            vec![OwnedFd::from(s1.try_clone().unwrap())],
        );
        st.store(
            b"FDSTORE=1\nFDNAME=two\n",
            vec![OwnedFd::from(s2.try_clone().unwrap())],
        );
        st.store(
            b"FDSTORE=1\nFDNAME=three\nFDPOLL=0\n",
            vec![OwnedFd::from(s3.try_clone().unwrap())],
        );
        c1.write_all(b"data for the engine").unwrap();
        assert!(st.hung_up().is_empty(), "data is no hang-up");
        // The engine ends its side, the client closes: a hang-up.
        s2.shutdown(std::net::Shutdown::Write).unwrap();
        drop(c2);
        s3.shutdown(std::net::Shutdown::Write).unwrap();
        drop(c3);
        let t = std::time::Instant::now();
        let mut gone = Vec::new();
        while gone.is_empty() && t.elapsed() < std::time::Duration::from_secs(10) {
            gone = st.hung_up();
        }
        assert_eq!(gone.len(), 1);
        let names: Vec<String> = st.copies().into_iter().map(|(n, _)| n).collect();
        assert_eq!(names, ["one", "three"]);
        assert_eq!(st.status().hung_up, 1);
        drop(s1);
    }
}
