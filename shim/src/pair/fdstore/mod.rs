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
//! handed to; `hangups` is the task that drops what hung up.

use std::collections::{BTreeMap, HashMap};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::sync::{Arc, Mutex, MutexGuard};

use nix::sys::epoll::{Epoll, EpollCreateFlags, EpollEvent, EpollFlags, EpollTimeout};
use serde::Serialize;
use shadow_contract::fdstore::{name_is_valid, DEFAULT_NAME};
use shadow_contract::state::FdStoreStatus;

use super::input::{Input, Inputs};
use super::notify::release_now;
use crate::error::{Error, Result};

pub mod accepted;
pub mod hangups;

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

    /// The `reason` label of `shadow_fdstore_refused_total`.
    pub fn label(self) -> &'static str {
        match self {
            Refused::WrongType => "wrong_type",
            Refused::Full => "full",
            Refused::BadName => "bad_name",
        }
    }
}

/// What the store did since the pair started, for state.json and metrics.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Counts {
    /// Descriptors kept.
    pub stored: u64,
    /// Dropped by `FDSTOREREMOVE=1`.
    pub removed: u64,
    /// Dropped because their peer hung up.
    pub hung_up: u64,
    /// Handed out by fetches.
    pub fetched: u64,
    /// Fetches answered.
    pub fetches: u64,
    /// Fetches refused (not the lock holder, not the slot's engine, busy).
    pub fetches_refused: u64,
    /// Not kept, by reason.
    pub refused: HashMap<Refused, u64>,
    /// Connections the runtime accepted (`shadow.dev/accept: runtime`).
    pub accepted: u64,
    /// Of those, handed to a serving engine through its hand-off socket.
    pub handed: u64,
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
    counts: Counts,
    /// Something changed since the publisher last looked.
    moved: bool,
    /// The names of the connections the runtime accepted, and the engine
    /// each was handed to (through its socket or a fetch), if any yet.
    accepted: HashMap<String, Option<Recipient>>,
    /// Signalled when descriptors leave the store: an acceptor that
    /// stopped at the bound goes on.
    room: Arc<tokio::sync::Notify>,
}

/// The store as the readers, the fetch servers, the spawner and the
/// supervisor share it (each holds the lock only for an update or a copy).
pub type Shared = Arc<Mutex<FdStore>>;

pub fn lock(store: &Shared) -> MutexGuard<'_, FdStore> {
    store.lock().unwrap_or_else(|p| p.into_inner())
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
            counts: Counts::default(),
            moved: false,
            accepted: HashMap::new(),
            room: Arc::new(tokio::sync::Notify::new()),
        })
    }

    /// What the store holds and did, as state.json and the metrics say it
    /// (every reason of refusal, 0 included).
    pub fn status(&self) -> FdStoreStatus {
        let c = &self.counts;
        FdStoreStatus {
            fds: self.entries.len() as u64,
            max: self.max as u64,
            stored: c.stored,
            removed: c.removed,
            hung_up: c.hung_up,
            fetched: c.fetched,
            fetches: c.fetches,
            fetches_refused: c.fetches_refused,
            accepted: c.accepted,
            handed: c.handed,
            refused: Refused::ALL
                .iter()
                .map(|r| {
                    (
                        r.label().to_string(),
                        c.refused.get(r).copied().unwrap_or(0),
                    )
                })
                .collect(),
        }
    }

    /// Records a change; true when it is the first since the publisher
    /// last looked (whoever made it then nudges the supervisor, once).
    pub fn touch(&mut self) -> bool {
        !std::mem::replace(&mut self.moved, true)
    }

    /// Whether anything changed since the last [`FdStore::take_moved`].
    pub fn moved(&self) -> bool {
        self.moved
    }

    pub fn take_moved(&mut self) -> bool {
        std::mem::replace(&mut self.moved, false)
    }

    fn refuse(&mut self, why: Refused, n: usize) {
        *self.counts.refused.entry(why).or_default() += n as u64;
    }

    /// `FDSTORE=1` with `fds`: keeps each socket and memfd while there is
    /// room, under the datagram's `FDNAME=` (all of a datagram's
    /// descriptors share its name, as systemd has it).
    pub fn store(&mut self, text: &[u8], fds: Vec<OwnedFd>) -> Stored {
        let (name, poll) = name_and_poll(text);
        let mut out = Stored::default();
        let Some(name) = name else {
            self.refuse(Refused::BadName, fds.len());
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
            self.counts.stored += 1;
            out.kept += 1;
        }
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
        self.room.notify_one();
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
        if !tokens.is_empty() {
            self.room.notify_one();
        }
        let (entries, epoll) = (&mut self.entries, &self.epoll);
        let gone: Vec<OwnedFd> = tokens
            .into_iter()
            .filter_map(|t| entries.remove(&t))
            .map(|e| unwatch(epoll, e))
            .collect();
        self.counts.removed += gone.len() as u64;
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
        self.counts.hung_up += gone.len() as u64;
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

    /// Signalled whenever descriptors leave the store.
    pub fn room(&self) -> Arc<tokio::sync::Notify> {
        self.room.clone()
    }

    /// A fetch was answered with `n` descriptors.
    pub fn fetched(&mut self, n: usize) {
        self.counts.fetches += 1;
        self.counts.fetched += n as u64;
    }

    pub fn fetch_refused(&mut self) {
        self.counts.fetches_refused += 1;
    }

    /// The epoll's descriptor (readable when a stored socket hung up).
    fn epoll_fd(&self) -> BorrowedFd<'_> {
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

/// Tells the supervisor the store's figures moved (it republishes within
/// `publish::COUNTERS_EVERY`); a full queue has it busy anyway.
fn nudge(tx: &Inputs) {
    let _ = tx.try_send(Input::StoreMoved);
}

/// Updates the store under its lock, `f` saying whether its figures
/// moved; the supervisor hears of the first move since they were written
/// ([`Input::StoreMoved`]), after the lock is let go. The one place of
/// the lock, touch and nudge sequence.
pub fn update<R>(store: &Shared, tx: &Inputs, f: impl FnOnce(&mut FdStore) -> (R, bool)) -> R {
    let (out, first) = {
        let mut st = lock(store);
        let (out, moved) = f(&mut st);
        (out, moved && st.touch())
    };
    if first {
        nudge(tx);
    }
    out
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
