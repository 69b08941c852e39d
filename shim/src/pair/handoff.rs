//! The runtime accepts (`shadow.dev/accept: runtime`): an engine that
//! accepts a connection and is killed before its `FDSTORE=1` takes that
//! connection with it, so here the shim accepts on the pair's listening
//! sockets itself, puts each connection in the fd store the moment it
//! exists, and hands it to the serving engine through a hand-off socket of
//! that engine's own (the protocol is `shadow_contract::handoff`'s).
//!
//! The shim touches a connection once, at its accept: it never reads,
//! writes or waits on it, and an engine that does not read its hand-off
//! socket only stops its own connections from coming (they wait in the
//! store, bounded by `shadow.dev/fdstore-max`, then in the kernel's
//! backlog). Who is handed connections is `shadow_pair::Connections`'s
//! decision, from what it is told here: a `READY=1` sent by the lock
//! holder (seen by the notify socket's reader), the supervisor's active
//! engine (a `READY=1` believed), a fetch answered for the lock holder,
//! an engine started, lost or gone; a respawn of a slot is another engine, handed
//! nothing until it proves it holds the lock. What was handed to an engine that died is the
//! next one's through its fetch (`FdStore::copies_for`).

use std::collections::VecDeque;
use std::io::IoSlice;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::{Arc, Mutex, MutexGuard};

use nix::fcntl::{fcntl, FcntlArg, OFlag};
use nix::sys::socket::{
    accept4, sendmsg, socketpair, AddressFamily, ControlMessage, MsgFlags, SockFlag, SockType,
};
use shadow_pair::{ConnEvent, Connections, SlotId};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use super::fdstore::accepted::Hand;
use super::fdstore::{self, Recipient, Shared};
use super::input::Inputs;
use super::owner;
use crate::error::{Error, Result};

/// Connections accepted in one go before the hand-offs and the rest of the
/// runtime get their turn.
const ACCEPT_BATCH: usize = 64;

/// One engine's hand-off sockets (the shim's ends), one per listener.
struct Ends {
    serial: u64,
    socks: Vec<Arc<AsyncFd<OwnedFd>>>,
}

/// The hand-off sockets, and who is handed connections now (decided by
/// `shadow_pair::Connections`, the one place that says it).
struct Targets {
    decided: Connections,
    /// Per slot: its current engine's ends.
    ends: Vec<Option<Ends>>,
    next_serial: u64,
}

impl Targets {
    /// Takes in `event`: whether the recipient moved.
    fn tell(&mut self, id: &str, event: ConnEvent) -> bool {
        let moved = self.decided.handle(event);
        if moved {
            match self.decided.recipient() {
                Some(r) => log::debug!("pair {id}: connections go to slot {} ({event:?})", r.slot),
                None => log::debug!("pair {id}: connections wait in the store ({event:?})"),
            }
        }
        moved
    }
}

/// What the supervisor and the fetch servers tell the hand-offs: a trait,
/// so that the supervisor's race tests stand a fake in for [`Handoff`].
pub trait Handing: Send + Sync {
    /// Starts accepting (once; the pair started); `tx` hears when the
    /// store's figures moved.
    fn start(self: Arc<Self>, tx: &Inputs) -> Result<()>;
    /// `slot`'s engine (the one running now) was answered its fetch.
    fn fetch_answered(&self, slot: SlotId);
    /// `slot`'s engine (the one running now) said `READY=1` from a
    /// process seen holding the lock.
    fn ready_from_holder(&self, slot: SlotId);
    /// The slot handed connections now, if any.
    fn serving(&self) -> Option<SlotId>;
    /// The engine now running in `slot`, as a recipient.
    fn recipient(&self, slot: SlotId) -> Option<Recipient>;
    /// The supervisor's active engine now (told after each of its steps).
    fn active_is(&self, now: Option<SlotId>);
    /// The engine now in `slot` died (its reap).
    fn died(&self, slot: SlotId);
    /// The pair ended: no more accepts, every hand-off socket closed.
    fn stop(&self);
    /// `slot`'s engine was seen not holding the lock.
    fn lock_lost(&self, slot: SlotId);
}

impl Handing for Handoff {
    fn start(self: Arc<Self>, tx: &Inputs) -> Result<()> {
        Handoff::start(&self, tx)
    }
    fn fetch_answered(&self, slot: SlotId) {
        Handoff::fetch_answered(self, slot)
    }
    fn ready_from_holder(&self, slot: SlotId) {
        Handoff::ready_from_holder(self, slot)
    }
    fn serving(&self) -> Option<SlotId> {
        self.targets().decided.recipient().map(|r| r.slot)
    }
    fn recipient(&self, slot: SlotId) -> Option<Recipient> {
        Handoff::recipient(self, slot)
    }
    fn active_is(&self, now: Option<SlotId>) {
        Handoff::active_is(self, now)
    }
    fn died(&self, slot: SlotId) {
        Handoff::died(self, slot)
    }
    fn stop(&self) {
        Handoff::stop(self)
    }
    fn lock_lost(&self, slot: SlotId) {
        Handoff::lock_lost(self, slot)
    }
}

/// The pair's acceptors and hand-off sockets; see the module doc.
pub struct Handoff {
    id: String,
    store: Shared,
    listeners: usize,
    targets: Mutex<Targets>,
    /// Bumped whenever who serves, or an engine's sockets, change.
    changed: watch::Sender<u64>,
    /// Copies of the pair's listening sockets, until the acceptors start.
    listening: Mutex<Vec<OwnedFd>>,
    tasks: Mutex<Vec<JoinHandle<()>>>,
}

impl Handoff {
    /// For a pair with `slots` engines, accepting on `listening` (copies
    /// of its listening sockets, in their order) once started.
    pub fn new(id: &str, store: Shared, listening: Vec<OwnedFd>, slots: usize) -> Arc<Self> {
        let (changed, _) = watch::channel(0);
        Arc::new(Handoff {
            id: id.to_owned(),
            store,
            listeners: listening.len(),
            listening: Mutex::new(listening),
            targets: Mutex::new(Targets {
                decided: Connections::new(),
                ends: (0..slots).map(|_| None).collect(),
                next_serial: 1,
            }),
            changed,
            tasks: Mutex::new(Vec::new()),
        })
    }

    fn targets(&self) -> MutexGuard<'_, Targets> {
        self.targets.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn bump(&self) {
        self.changed.send_modify(|n| *n = n.wrapping_add(1));
    }

    /// Starts accepting (once; the pair started), until [`Handoff::stop`];
    /// `tx` hears when the store's figures moved.
    pub fn start(self: &Arc<Self>, tx: &Inputs) -> Result<()> {
        let conns = owner::handle()?;
        // The listeners are watched by the connection thread's reactor.
        let _on_conns = conns.enter();
        let listening =
            std::mem::take(&mut *self.listening.lock().unwrap_or_else(|p| p.into_inner()));
        let mut tasks = self.tasks.lock().unwrap_or_else(|p| p.into_inner());
        for (index, fd) in listening.into_iter().enumerate() {
            // This copy's open file is the pair's one listening socket, and
            // no engine has it in this mode: non-blocking is the shim's own.
            set_nonblocking(&fd, "a listening socket")?;
            // SAFETY: the AsyncFd owns `fd` (an OwnedFd) and neither closes
            // nor replaces it while registered.
            let listener = unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }
                .map_err(|e| Error::io("watching a listening socket", e.into()))?;
            tasks.push(conns.spawn(accept_and_hand(self.clone(), index, listener, tx.clone())));
        }
        Ok(())
    }

    /// The pair ended: no more accepts, every hand-off socket closed.
    pub fn stop(&self) {
        for t in self
            .tasks
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
        {
            t.abort();
        }
        let mut t = self.targets();
        t.decided = Connections::new();
        for e in &mut t.ends {
            *e = None;
        }
    }

    /// A new engine of `slot` starts: its ends of fresh hand-off sockets,
    /// one per listener, for its `LISTEN_FDS` (blocking, as engines
    /// expect); the shim's ends replace the slot's previous engine's. The
    /// new engine serves only once it is said to.
    pub fn ends_for(&self, slot: SlotId) -> Result<Vec<OwnedFd>> {
        let conns = owner::handle()?;
        // Watched by the connection thread's reactor, as the acceptors.
        let _on_conns = conns.enter();
        let mut theirs = Vec::with_capacity(self.listeners);
        let mut ours = Vec::with_capacity(self.listeners);
        for _ in 0..self.listeners {
            let (mine, engine) = socketpair(
                AddressFamily::Unix,
                SockType::SeqPacket,
                None,
                SockFlag::SOCK_CLOEXEC,
            )
            .map_err(|e| Error::sys("socketpair(AF_UNIX, SOCK_SEQPACKET) for a hand-off", e))?;
            // The shim's end only: the engine's stays blocking.
            set_nonblocking(&mine, "a hand-off socket")?;
            // SAFETY: the AsyncFd owns `mine` (an OwnedFd) and neither
            // closes nor replaces it while registered.
            let mine = unsafe { AsyncFd::register_with_interest(mine, Interest::WRITABLE) }
                .map_err(|e| Error::io("watching a hand-off socket", e.into()))?;
            ours.push(Arc::new(mine));
            theirs.push(engine);
        }
        {
            let mut t = self.targets();
            let serial = t.next_serial;
            t.next_serial += 1;
            t.ends[slot.index()] = Some(Ends {
                serial,
                socks: ours,
            });
            t.tell(&self.id, ConnEvent::Started { slot, serial });
        }
        self.bump();
        Ok(theirs)
    }

    /// Tells the decision `event`; the acceptors hear when the recipient
    /// moved.
    fn tell(&self, event: ConnEvent) {
        if self.targets().tell(&self.id, event) {
            self.bump();
        }
    }

    /// `slot`'s engine (the one running now) was answered its fetch: it
    /// held the lock, and is handed what was accepted from now on (and
    /// what waits).
    pub fn fetch_answered(&self, slot: SlotId) {
        let engine = self.targets().decided.engine(slot);
        if let Some(r) = engine {
            self.tell(ConnEvent::FetchAnswered {
                slot,
                serial: r.serial,
            });
        }
    }

    /// `slot`'s engine (the one running now) said `READY=1` from a
    /// process holding the lock: it serves, as after its fetch.
    pub fn ready_from_holder(&self, slot: SlotId) {
        let engine = self.targets().decided.engine(slot);
        if let Some(r) = engine {
            self.tell(ConnEvent::ReadyFromHolder {
                slot,
                serial: r.serial,
            });
        }
    }

    /// `slot`'s engine was seen not holding the lock: it is handed
    /// nothing more (a new proof of it makes it the recipient again).
    pub fn lock_lost(&self, slot: SlotId) {
        self.tell(ConnEvent::LockLost { slot });
    }

    /// The supervisor's active engine now; what a change means is the
    /// decision's (`ConnEvent::Active`).
    pub fn active_is(&self, now: Option<SlotId>) {
        self.tell(ConnEvent::Active(now));
    }

    /// The engine now in `slot` died: it is handed nothing more, and the
    /// shim's ends of its hand-off sockets close.
    pub fn died(&self, slot: SlotId) {
        let ends = {
            let mut t = self.targets();
            t.tell(&self.id, ConnEvent::Died { slot });
            t.ends.get_mut(slot.index()).and_then(Option::take)
        };
        drop(ends);
        self.bump();
    }

    /// The engine now running in `slot`, as a recipient.
    pub fn recipient(&self, slot: SlotId) -> Option<Recipient> {
        self.targets().decided.engine(slot)
    }

    /// Whom listener `index`'s connections go to now, and through what.
    fn current(&self, index: usize) -> Option<(Recipient, Arc<AsyncFd<OwnedFd>>)> {
        let t = self.targets();
        let who = t.decided.recipient()?;
        let e = t.ends[who.slot.index()].as_ref()?;
        if e.serial != who.serial {
            return None;
        }
        Some((who, e.socks.get(index)?.clone()))
    }

    /// A send to `who` failed for good: it died, and is handed no more.
    fn lost(&self, who: Recipient) {
        {
            let mut t = self.targets();
            let i = who.slot.index();
            if t.ends[i].as_ref().is_some_and(|e| e.serial == who.serial) {
                t.ends[i] = None;
            }
            t.tell(
                &self.id,
                ConnEvent::Lost {
                    slot: who.slot,
                    serial: who.serial,
                },
            );
        }
        self.bump();
    }

    /// Hands what waits on listener `index`, in order, while there is a
    /// recipient with room; the socket that had none, to wait on.
    fn hand_waiting(
        &self,
        index: usize,
        waiting: &mut VecDeque<u64>,
        tx: &Inputs,
    ) -> Option<Arc<AsyncFd<OwnedFd>>> {
        while let Some(&token) = waiting.front() {
            let (who, sock) = self.current(index)?;
            let sent = fdstore::update(&self.store, tx, |st| {
                let out = st.hand(token, who, |name, conn| {
                    send(sock.get_ref().as_fd(), name, conn)
                });
                (out, matches!(out, Hand::Sent))
            });
            match sent {
                Hand::Sent | Hand::Gone => {
                    waiting.pop_front();
                }
                Hand::Full => return Some(sock),
                Hand::Failed(e) => {
                    log::warn!(
                        "pair {}: handing a connection to slot {}'s engine: {e}: it stays in the store for the next takeover",
                        self.id,
                        who.slot
                    );
                    waiting.pop_front();
                }
                Hand::Lost(e) => {
                    log::info!(
                        "pair {}: the hand-off socket of slot {}'s engine: {e}: it is handed no more",
                        self.id,
                        who.slot
                    );
                    self.lost(who);
                }
            }
        }
        None
    }
}

/// `O_NONBLOCK` on `fd`'s open file (`what` it is, for the error).
fn set_nonblocking(fd: &OwnedFd, what: &str) -> Result<()> {
    let flags = fcntl(fd, FcntlArg::F_GETFL)
        .map_err(|e| Error::sys(format!("fcntl(F_GETFL) of {what}"), e))?;
    fcntl(
        fd,
        FcntlArg::F_SETFL(OFlag::from_bits_truncate(flags) | OFlag::O_NONBLOCK),
    )
    .map(|_| ())
    .map_err(|e| Error::sys(format!("fcntl(O_NONBLOCK) of {what}"), e))
}

/// One packet on a hand-off socket, never waiting.
fn send(sock: BorrowedFd<'_>, name: &str, conn: BorrowedFd<'_>) -> nix::Result<()> {
    let text = shadow_contract::handoff::packet(name);
    let fds = [conn.as_raw_fd()];
    sendmsg::<()>(
        sock.as_raw_fd(),
        &[IoSlice::new(text.as_bytes())],
        &[ControlMessage::ScmRights(&fds)],
        MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_NOSIGNAL,
        None,
    )
    .map(|_| ())
}

/// Listener `index`'s loop: accept while the store has room, keep each
/// connection there, hand it on to whoever serves.
async fn accept_and_hand(h: Arc<Handoff>, index: usize, listener: AsyncFd<OwnedFd>, tx: Inputs) {
    let mut changed = h.changed.subscribe();
    let room = fdstore::lock(&h.store).room();
    let mut waiting: VecDeque<u64> = VecDeque::new();
    loop {
        let blocked = h.hand_waiting(index, &mut waiting, &tx);
        let has_room = {
            let mut st = fdstore::lock(&h.store);
            let room = st.has_room();
            if !room {
                st.watch_handed();
            }
            room
        };
        tokio::select! {
            ready = listener.readable(), if has_room => {
                let Ok(mut ready) = ready else {
                    log::warn!("pair {}: listening socket {index} is no longer watched", h.id);
                    return;
                };
                if accept_some(&h, index, listener.get_ref().as_fd(), &mut waiting, &tx) {
                    ready.clear_ready();
                }
            }
            seen = changed.changed() => {
                if seen.is_err() {
                    return;
                }
            }
            ready = writable(blocked.as_deref()), if blocked.is_some() => {
                if let Some(mut ready) = ready {
                    ready.clear_ready();
                }
            }
            _ = room.notified(), if !has_room => {}
        }
    }
}

async fn writable(
    sock: Option<&AsyncFd<OwnedFd>>,
) -> Option<tokio::io::unix::AsyncFdReadyGuard<'_, OwnedFd>> {
    sock?.writable().await.ok()
}

/// Accepts up to [`ACCEPT_BATCH`] connections into the store: whether the
/// listener has none left (its readiness is spent). Each accept happens
/// under the store's lock, once it has room: a connection is never taken
/// from the backlog without a place in the store.
fn accept_some(
    h: &Handoff,
    index: usize,
    listener: BorrowedFd<'_>,
    waiting: &mut VecDeque<u64>,
    tx: &Inputs,
) -> bool {
    /// One accept's outcome, under the store's lock.
    enum Took {
        Kept(u64),
        /// The store is full (no accept made).
        Full,
        /// The listener has none left, or failed: this round ends.
        Spent,
        Again,
    }
    for _ in 0..ACCEPT_BATCH {
        let took = fdstore::update(&h.store, tx, |st| {
            if !st.has_room() {
                return (Took::Full, false);
            }
            // Blocking and close-on-exec: the engine that is handed it
            // gets the connection as its own accept would have made it.
            let conn = match accept4(listener.as_raw_fd(), SockFlag::SOCK_CLOEXEC) {
                // SAFETY: accept4 just returned this descriptor; it is
                // owned here and nowhere else.
                Ok(raw) => unsafe { OwnedFd::from_raw_fd(raw) },
                Err(nix::errno::Errno::EAGAIN) => return (Took::Spent, false),
                Err(nix::errno::Errno::EINTR | nix::errno::Errno::ECONNABORTED) => {
                    return (Took::Again, false)
                }
                // Out of descriptors, or memory: this round ends; the
                // next readiness tries again.
                Err(e) => {
                    log::warn!("pair {}: accept on listening socket {index}: {e}", h.id);
                    return (Took::Spent, false);
                }
            };
            match st.accept(index, conn) {
                Ok(token) => (Took::Kept(token), true),
                // Room was there under the same lock.
                Err(_) => (Took::Full, false),
            }
        });
        match took {
            Took::Kept(token) => waiting.push_back(token),
            Took::Again => continue,
            Took::Full => return false,
            Took::Spent => return true,
        }
    }
    false
}

#[cfg(test)]
mod tests {
    //! The acceptors and hand-offs over real sockets: a TCP listener, the
    //! connections accepted on the connection thread and sent with
    //! `SCM_RIGHTS` through `SOCK_SEQPACKET` socket pairs, as an engine
    //! receives them.

    use std::io::{IoSliceMut, Read, Write};
    use std::net::{TcpListener, TcpStream};
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    use std::time::Duration;

    use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};

    use super::*;
    use crate::pair::fdstore::FdStore;
    use crate::pair::input;

    const S0: SlotId = SlotId::ZERO;
    const S1: SlotId = SlotId::ONE;

    /// One packet off an engine's (blocking) hand-off end: its name and
    /// connection; None when nothing came within `wait`.
    fn receive(end: &OwnedFd, wait: Duration) -> Option<(String, TcpStream)> {
        let tv =
            nix::sys::time::TimeVal::new(wait.as_secs() as i64, i64::from(wait.subsec_micros()));
        nix::sys::socket::setsockopt(end, nix::sys::socket::sockopt::ReceiveTimeout, &tv)
            .expect("SO_RCVTIMEO");
        let mut buf = [0u8; 256];
        let mut iov = [IoSliceMut::new(&mut buf)];
        let mut space = nix::cmsg_space!([std::os::fd::RawFd; 1]);
        let msg = recvmsg::<()>(
            end.as_raw_fd(),
            &mut iov,
            Some(&mut space),
            MsgFlags::empty(),
        )
        .ok()?;
        let fd = msg.cmsgs().ok()?.find_map(|c| match c {
            ControlMessageOwned::ScmRights(fds) => fds.first().copied(),
            _ => None,
        })?;
        let len = msg.bytes;
        // SAFETY: SCM_RIGHTS just installed this descriptor in this
        // process; it is owned here and nowhere else.
        let conn = unsafe { OwnedFd::from_raw_fd(fd) };
        let text = String::from_utf8_lossy(&buf[..len]).into_owned();
        let name = text.strip_prefix("FDNAME=")?.trim_end().to_owned();
        Some((name, TcpStream::from(conn)))
    }

    struct Rig {
        h: Arc<Handoff>,
        store: Shared,
        addr: std::net::SocketAddr,
        _inputs: tokio::sync::mpsc::Receiver<input::Input>,
    }

    fn rig() -> Rig {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("address");
        let store: Shared = Arc::new(Mutex::new(FdStore::new(16).expect("store")));
        let h = Handoff::new("t", store.clone(), vec![OwnedFd::from(listener)], 2);
        let (tx, rx) = input::channel();
        Handoff::start(&h, &tx).expect("start");
        Rig {
            h,
            store,
            addr,
            _inputs: rx,
        }
    }

    /// The client's bytes reach the handed connection, and back.
    fn talks(client: &mut TcpStream, handed: &mut TcpStream) {
        client.write_all(b"ping").expect("client write");
        let mut got = [0u8; 4];
        handed.read_exact(&mut got).expect("engine read");
        assert_eq!(&got, b"ping");
        handed.write_all(b"pong").expect("engine write");
        client.read_exact(&mut got).expect("client read");
        assert_eq!(&got, b"pong");
    }

    #[tokio::test]
    async fn the_proven_engine_is_handed_each_connection_and_a_parked_one_nothing() {
        let r = rig();
        let e0 = r.h.ends_for(S0).expect("ends of slot 0").remove(0);
        let e1 = r.h.ends_for(S1).expect("ends of slot 1").remove(0);
        // Nobody proven yet: the connection waits in the store.
        let mut c1 = TcpStream::connect(r.addr).expect("connect");
        assert!(receive(&e0, Duration::from_millis(200)).is_none());
        assert_eq!(fdstore::lock(&r.store).status().accepted, 1);
        // Slot 0's fetch is answered: what waited is handed to it, and
        // what comes next; slot 1, parked, gets nothing.
        r.h.fetch_answered(S0);
        let (name, mut h1) = receive(&e0, Duration::from_secs(10)).expect("handed");
        assert!(name.starts_with("accepted."), "{name}");
        talks(&mut c1, &mut h1);
        let mut c2 = TcpStream::connect(r.addr).expect("connect");
        let (_, mut h2) = receive(&e0, Duration::from_secs(10)).expect("handed");
        talks(&mut c2, &mut h2);
        assert!(receive(&e1, Duration::from_millis(100)).is_none());
        assert_eq!(fdstore::lock(&r.store).status().handed, 2);
        r.h.stop();
    }

    #[tokio::test]
    async fn a_dead_engines_connections_wait_for_the_next_proven_one() {
        let r = rig();
        let e0 = r.h.ends_for(S0).expect("ends of slot 0").remove(0);
        let e1 = r.h.ends_for(S1).expect("ends of slot 1").remove(0);
        r.h.active_is(Some(S0));
        // Slot 0's engine dies (its end closes): the next send fails for
        // good, and that connection stays in the store.
        drop(e0);
        let mut c = TcpStream::connect(r.addr).expect("connect");
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        while r.h.recipient(S0).is_some() && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(r.h.recipient(S0), None, "the dead engine is lost");
        assert!(receive(&e1, Duration::from_millis(100)).is_none());
        // Slot 1 proves it holds the lock (its READY=1 believed): the
        // connection that waited is its.
        r.h.active_is(Some(S1));
        let (_, mut handed) = receive(&e1, Duration::from_secs(10)).expect("handed");
        talks(&mut c, &mut handed);
        r.h.stop();
    }

    #[tokio::test]
    async fn a_lock_lost_stops_the_hand_offs_until_a_new_proof() {
        let r = rig();
        let e0 = r.h.ends_for(S0).expect("ends of slot 0").remove(0);
        r.h.fetch_answered(S0);
        r.h.lock_lost(S0);
        let mut c = TcpStream::connect(r.addr).expect("connect");
        assert!(receive(&e0, Duration::from_millis(200)).is_none());
        // A respawn of slot 0 is another engine: the old one's proof is
        // not its; its own READY is.
        let fresh = r.h.ends_for(S0).expect("fresh ends").remove(0);
        r.h.active_is(Some(S0));
        let (_, mut handed) = receive(&fresh, Duration::from_secs(10)).expect("handed");
        talks(&mut c, &mut handed);
        assert!(receive(&e0, Duration::from_millis(50)).is_none());
        r.h.stop();
    }
}
