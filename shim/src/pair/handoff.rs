//! The runtime accepts (`shadow.dev/accept: runtime`): an engine that
//! accepts a connection and is killed before its `FDSTORE=1` takes that
//! connection with it, so here the shim accepts on the pair's listening
//! sockets itself, puts each connection in the fd store the moment it
//! exists, and hands it to the serving engine through a hand-off socket of
//! that engine's own (the protocol is `shadow_contract::handoff`'s).
//!
//! One task does it, on the connection thread (`owner.rs`): it owns the
//! listening sockets, every engine's hand-off sockets, the connections
//! waiting to be handed and `shadow_pair::Connections`, which decides who
//! is handed them. Everything else tells it what happened through its
//! inbox ([`Told`]), in order, and never touches that state: the
//! supervisor (the active engine, a death, the lock seen lost), the
//! notify readers (a `READY=1` sent by the lock holder), the fetch servers
//! (a fetch answered for the lock holder) and each start of an engine
//! (its fresh ends). A respawn of a slot is another engine, handed nothing
//! until it proves it holds the lock; what was handed to an engine that
//! died is the next one's through its fetch (`FdStore::copies_for`).
//!
//! The shim touches a connection once, at its accept: it never reads,
//! writes or waits on it, and an engine that does not read its hand-off
//! socket only stops its own connections from coming (they wait in the
//! store, bounded by `shadow.dev/fdstore-max`, then in the kernel's
//! backlog).

use std::collections::VecDeque;
use std::future::poll_fn;
use std::io::IoSlice;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::Poll;

use async_trait::async_trait;
use nix::fcntl::{fcntl, FcntlArg, OFlag};
use nix::sys::socket::{
    accept4, sendmsg, socketpair, AddressFamily, ControlMessage, MsgFlags, SockFlag, SockType,
};
use shadow_pair::{ConnEvent, Connections, Recipient, SlotId};
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use super::fdstore::accepted::Hand;
use super::fdstore::{self, Shared};
use super::input::Inputs;
use super::owner;
use crate::error::{Error, Result};

/// Connections accepted in one go before the inbox and the hand-offs get
/// their turn.
const ACCEPT_BATCH: usize = 64;

/// [`Handoff::serving`]'s word for "nobody".
const NOBODY: u64 = u64::MAX;

/// A hand-off socket (the shim's end), watched by the connection thread.
type End = Arc<AsyncFd<OwnedFd>>;

/// What the hand-off task is told: its inbox, read in order.
enum Told {
    /// A new engine of `slot` starts with these ends (one per listener).
    Started {
        slot: SlotId,
        serial: u64,
        ends: Vec<End>,
    },
    /// `slot`'s engine was answered its fetch; the reply says which
    /// engine that is (none: no engine of it has ends).
    FetchAnswered {
        slot: SlotId,
        reply: oneshot::Sender<Option<Recipient>>,
    },
    /// `slot`'s engine said `READY=1` from a process holding the lock.
    ReadyFromHolder { slot: SlotId },
    /// The supervisor's active engine now.
    Active(Option<SlotId>),
    /// `slot`'s engine died (its reap).
    Died { slot: SlotId },
    /// `slot`'s engine was seen not holding the lock.
    LockLost { slot: SlotId },
    #[cfg(test)]
    /// The engine now in `slot`, as a recipient.
    Engine {
        slot: SlotId,
        reply: oneshot::Sender<Option<Recipient>>,
    },
}

/// What the supervisor and the fetch servers tell the hand-offs: a trait,
/// so that the supervisor's race tests stand a fake in for [`Handoff`].
#[async_trait]
pub trait Handing: Send + Sync {
    /// Starts accepting (once; the pair started); `tx` hears when the
    /// store's figures moved.
    fn start(self: Arc<Self>, tx: &Inputs) -> Result<()>;
    /// `slot`'s engine (the one running now) was answered its fetch:
    /// that engine, once the hand-offs have taken it in.
    async fn fetch_answered(&self, slot: SlotId) -> Option<Recipient>;
    /// `slot`'s engine (the one running now) said `READY=1` from a
    /// process seen holding the lock.
    fn ready_from_holder(&self, slot: SlotId);
    /// The slot handed connections now, if any (as last decided).
    fn serving(&self) -> Option<SlotId>;
    /// The supervisor's active engine now (told after each of its steps).
    fn active_is(&self, now: Option<SlotId>);
    /// The engine now in `slot` died (its reap).
    fn died(&self, slot: SlotId);
    /// The pair ended: no more accepts, every hand-off socket closed.
    fn stop(&self);
    /// `slot`'s engine was seen not holding the lock.
    fn lock_lost(&self, slot: SlotId);
}

#[async_trait]
impl Handing for Handoff {
    fn start(self: Arc<Self>, tx: &Inputs) -> Result<()> {
        Handoff::start(&self, tx)
    }
    async fn fetch_answered(&self, slot: SlotId) -> Option<Recipient> {
        Handoff::fetch_answered(self, slot).await
    }
    fn ready_from_holder(&self, slot: SlotId) {
        self.tell(Told::ReadyFromHolder { slot });
    }
    fn serving(&self) -> Option<SlotId> {
        Handoff::serving(self)
    }
    fn active_is(&self, now: Option<SlotId>) {
        Handoff::active_is(self, now)
    }
    fn died(&self, slot: SlotId) {
        self.tell(Told::Died { slot });
    }
    fn stop(&self) {
        Handoff::stop(self)
    }
    fn lock_lost(&self, slot: SlotId) {
        self.tell(Told::LockLost { slot });
    }
}

/// What the hand-off task starts with.
struct Unstarted {
    inbox: mpsc::UnboundedReceiver<Told>,
    /// Copies of the pair's listening sockets, in their order.
    listening: Vec<OwnedFd>,
    store: Shared,
}

/// The hand-off task's handle: its inbox, and what it needs to start.
pub struct Handoff {
    id: String,
    listeners: usize,
    slots: usize,
    inbox: mpsc::UnboundedSender<Told>,
    /// What the task starts with, until [`Handoff::start`] takes it.
    unstarted: Mutex<Option<Unstarted>>,
    task: Mutex<Option<JoinHandle<()>>>,
    /// Each engine's serial, from 1: given at its start, before the task
    /// hears of it.
    next_serial: AtomicU64,
    /// The slot handed connections, as the task last decided ([`NOBODY`]):
    /// a look for the notify readers, never a decision.
    serving: Arc<AtomicU64>,
    /// The active engine last sent to the task ([`NOBODY`]): the
    /// supervisor says it after every step, and only a change is worth a
    /// message to the connection thread. The supervisor is its one sender.
    active_sent: AtomicU64,
}

impl Handoff {
    /// For a pair with `slots` engines, accepting on `listening` (copies
    /// of its listening sockets, in their order) once started.
    pub fn new(id: &str, store: Shared, listening: Vec<OwnedFd>, slots: usize) -> Arc<Self> {
        let (inbox, rx) = mpsc::unbounded_channel();
        Arc::new(Handoff {
            id: id.to_owned(),
            listeners: listening.len(),
            slots,
            inbox,
            unstarted: Mutex::new(Some(Unstarted {
                inbox: rx,
                listening,
                store,
            })),
            task: Mutex::new(None),
            next_serial: AtomicU64::new(1),
            serving: Arc::new(AtomicU64::new(NOBODY)),
            active_sent: AtomicU64::new(NOBODY),
        })
    }

    /// Tells the task `told`; nothing when it has ended (the pair did).
    fn tell(&self, told: Told) {
        let _ = self.inbox.send(told);
    }

    /// Starts accepting (once; the pair started), until [`Handoff::stop`];
    /// `tx` hears when the store's figures moved.
    pub fn start(&self, tx: &Inputs) -> Result<()> {
        let Some(Unstarted {
            inbox: rx,
            listening,
            store,
        }) = self
            .unstarted
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        else {
            return Ok(());
        };
        let conns = owner::handle()?;
        // The listeners are watched by the connection thread's reactor.
        let _on_conns = conns.enter();
        let mut listeners = Vec::with_capacity(listening.len());
        for fd in listening {
            // This copy's open file is the pair's one listening socket, and
            // no engine has it in this mode: non-blocking is the shim's own.
            set_nonblocking(&fd, "a listening socket")?;
            // SAFETY: the AsyncFd owns `fd` (an OwnedFd) and neither closes
            // nor replaces it while registered.
            let listener = unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }
                .map_err(|e| Error::io("watching a listening socket", e.into()))?;
            listeners.push(listener);
        }
        let room = fdstore::lock(&store).room();
        let task = Hands {
            id: self.id.clone(),
            waiting: vec![VecDeque::new(); listeners.len()],
            room,
            store,
            tx: tx.clone(),
            decided: Connections::new(),
            ends: (0..self.slots).map(|_| None).collect(),
            serving: self.serving.clone(),
        };
        let handle = conns.spawn(task.run(rx, listeners));
        *self.task.lock().unwrap_or_else(|p| p.into_inner()) = Some(handle);
        Ok(())
    }

    /// The pair ended: no more accepts; the task ends and every hand-off
    /// socket with it.
    pub fn stop(&self) {
        if let Some(t) = self.task.lock().unwrap_or_else(|p| p.into_inner()).take() {
            t.abort();
        }
        self.unstarted
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        self.serving.store(NOBODY, Ordering::Release);
    }

    /// A new engine of `slot` starts: its ends of fresh hand-off sockets,
    /// one per listener, for its `LISTEN_FDS` (blocking, as engines
    /// expect); the shim's ends replace the slot's previous engine's. The
    /// new engine serves only once it proves it holds the lock.
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
        let serial = self.next_serial.fetch_add(1, Ordering::Relaxed);
        self.tell(Told::Started {
            slot,
            serial,
            ends: ours,
        });
        Ok(theirs)
    }

    /// `slot`'s engine (the one running now) was answered its fetch: it
    /// held the lock, and is handed what was accepted from now on (and
    /// what waits). That engine, once the task has taken it in.
    pub async fn fetch_answered(&self, slot: SlotId) -> Option<Recipient> {
        let (reply, answer) = oneshot::channel();
        self.tell(Told::FetchAnswered { slot, reply });
        answer.await.ok().flatten()
    }

    /// The supervisor's active engine now: sent to the task when it
    /// changed since the last one sent (what a change means is the
    /// decision's, `ConnEvent::Active`).
    pub fn active_is(&self, now: Option<SlotId>) {
        let word = now.map_or(NOBODY, |s| s.index() as u64);
        if self.active_sent.swap(word, Ordering::AcqRel) != word {
            self.tell(Told::Active(now));
        }
    }

    /// The slot handed connections now, as the task last decided.
    pub fn serving(&self) -> Option<SlotId> {
        match self.serving.load(Ordering::Acquire) {
            NOBODY => None,
            n => usize::try_from(n).ok().and_then(SlotId::new),
        }
    }

    #[cfg(test)]
    /// The engine now in `slot`, as the task knows it.
    async fn engine(&self, slot: SlotId) -> Option<Recipient> {
        let (reply, answer) = oneshot::channel();
        self.tell(Told::Engine { slot, reply });
        answer.await.ok().flatten()
    }
}

/// One engine's hand-off sockets (the shim's ends), one per listener.
struct Ends {
    serial: u64,
    socks: Vec<End>,
}

/// The hand-off task's state: its alone.
struct Hands {
    id: String,
    store: Shared,
    tx: Inputs,
    /// Signalled whenever descriptors leave the store.
    room: Arc<tokio::sync::Notify>,
    /// Who is handed connections: the one place that says it.
    decided: Connections,
    /// Per slot: its current engine's ends.
    ends: Vec<Option<Ends>>,
    /// Per listener: the store's tokens of connections not handed yet, in
    /// the order they were accepted.
    waiting: Vec<VecDeque<u64>>,
    serving: Arc<AtomicU64>,
}

impl Hands {
    async fn run(
        mut self,
        mut inbox: mpsc::UnboundedReceiver<Told>,
        listeners: Vec<AsyncFd<OwnedFd>>,
    ) {
        // Where the look for a readable listener starts: each in turn, so
        // that a flood on one does not starve the others.
        let mut first = 0;
        loop {
            let blocked: Vec<End> = (0..listeners.len())
                .filter_map(|i| self.hand_waiting(i))
                .collect();
            let has_room = {
                let mut st = fdstore::lock(&self.store);
                let room = st.has_room();
                if !room {
                    st.watch_handed();
                }
                room
            };
            let room = self.room.clone();
            tokio::select! {
                // What it is told first: a proof moves connections before
                // more are accepted for nobody.
                biased;
                told = inbox.recv() => match told {
                    Some(told) => self.take(told),
                    None => return,
                },
                (index, ready) = readable(&listeners, first), if has_room => {
                    let Ok(mut ready) = ready else {
                        log::warn!("pair {}: listening socket {index} is no longer watched", self.id);
                        return;
                    };
                    first = (index + 1) % listeners.len();
                    if self.accept_some(index, listeners[index].get_ref().as_fd()) {
                        ready.clear_ready();
                    }
                }
                ready = writable(&blocked), if !blocked.is_empty() => {
                    if let Ok(mut ready) = ready {
                        ready.clear_ready();
                    }
                }
                _ = room.notified(), if !has_room => {}
            }
        }
    }

    /// Takes in what it was told.
    fn take(&mut self, told: Told) {
        let event = match told {
            Told::Started { slot, serial, ends } => {
                if let Some(e) = self.ends.get_mut(slot.index()) {
                    *e = Some(Ends {
                        serial,
                        socks: ends,
                    });
                }
                ConnEvent::Started { slot, serial }
            }
            Told::FetchAnswered { slot, reply } => {
                let engine = self.decided.engine(slot);
                let _ = reply.send(engine);
                let Some(r) = engine else { return };
                ConnEvent::FetchAnswered {
                    slot,
                    serial: r.serial,
                }
            }
            Told::ReadyFromHolder { slot } => {
                let Some(r) = self.decided.engine(slot) else {
                    return;
                };
                ConnEvent::ReadyFromHolder {
                    slot,
                    serial: r.serial,
                }
            }
            Told::Active(now) => ConnEvent::Active(now),
            Told::Died { slot } => {
                // Decided first, then its ends close: the engine is gone.
                let ends = self.ends.get_mut(slot.index()).and_then(Option::take);
                self.decide(ConnEvent::Died { slot });
                drop(ends);
                return;
            }
            Told::LockLost { slot } => ConnEvent::LockLost { slot },
            #[cfg(test)]
            Told::Engine { slot, reply } => {
                let _ = reply.send(self.decided.engine(slot));
                return;
            }
        };
        self.decide(event);
    }

    /// Tells the decision `event`, and logs a move of the recipient.
    fn decide(&mut self, event: ConnEvent) {
        if !self.decided.handle(event) {
            return;
        }
        let now = self.decided.recipient();
        match now {
            Some(r) => log::debug!(
                "pair {}: connections go to slot {} ({event:?})",
                self.id,
                r.slot
            ),
            None => log::debug!(
                "pair {}: connections wait in the store ({event:?})",
                self.id
            ),
        }
        let word = now.map_or(NOBODY, |r| r.slot.index() as u64);
        self.serving.store(word, Ordering::Release);
    }

    /// Whom listener `index`'s connections go to now, and through what.
    fn current(&self, index: usize) -> Option<(Recipient, End)> {
        let who = self.decided.recipient()?;
        let e = self.ends[who.slot.index()].as_ref()?;
        if e.serial != who.serial {
            return None;
        }
        Some((who, e.socks.get(index)?.clone()))
    }

    /// A send to `who` failed for good: it died, and is handed no more.
    fn lost(&mut self, who: Recipient) {
        let i = who.slot.index();
        if self.ends[i]
            .as_ref()
            .is_some_and(|e| e.serial == who.serial)
        {
            self.ends[i] = None;
        }
        self.decide(ConnEvent::Lost {
            slot: who.slot,
            serial: who.serial,
        });
    }

    /// Hands what waits on listener `index`, in order, while there is a
    /// recipient with room; the socket that had none, to wait on.
    fn hand_waiting(&mut self, index: usize) -> Option<End> {
        while let Some(&token) = self.waiting[index].front() {
            let (who, sock) = self.current(index)?;
            let sent = fdstore::update(&self.store, &self.tx, |st| {
                let out = st.hand(token, who, |name, conn| {
                    send(sock.get_ref().as_fd(), name, conn)
                });
                (out, matches!(out, Hand::Sent))
            });
            match sent {
                Hand::Sent | Hand::Gone => {
                    self.waiting[index].pop_front();
                }
                Hand::Full => return Some(sock),
                Hand::Failed(e) => {
                    log::warn!(
                        "pair {}: handing a connection to slot {}'s engine: {e}: it stays in the store for the next takeover",
                        self.id,
                        who.slot
                    );
                    self.waiting[index].pop_front();
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

    /// Accepts up to [`ACCEPT_BATCH`] connections into the store: whether
    /// the listener has none left (its readiness is spent). Each accept
    /// happens under the store's lock, once it has room: a connection is
    /// never taken from the backlog without a place in the store.
    fn accept_some(&mut self, index: usize, listener: BorrowedFd<'_>) -> bool {
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
            let took = fdstore::update(&self.store, &self.tx, |st| {
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
                        log::warn!("pair {}: accept on listening socket {index}: {e}", self.id);
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
                Took::Kept(token) => self.waiting[index].push_back(token),
                Took::Again => continue,
                Took::Full => return false,
                Took::Spent => return true,
            }
        }
        false
    }
}

/// The first listener readable, looking from `first` on.
async fn readable(
    listeners: &[AsyncFd<OwnedFd>],
    first: usize,
) -> (
    usize,
    std::io::Result<tokio::io::unix::AsyncFdReadyGuard<'_, OwnedFd>>,
) {
    let n = listeners.len();
    poll_fn(|cx| {
        for k in 0..n {
            let i = (first + k) % n;
            if let Poll::Ready(r) = listeners[i].poll_read_ready(cx) {
                return Poll::Ready((i, r));
            }
        }
        Poll::Pending
    })
    .await
}

/// The first of `socks` with room to send.
async fn writable(
    socks: &[End],
) -> std::io::Result<tokio::io::unix::AsyncFdReadyGuard<'_, OwnedFd>> {
    poll_fn(|cx| {
        for s in socks {
            if let Poll::Ready(r) = s.poll_write_ready(cx) {
                return Poll::Ready(r);
            }
        }
        Poll::Pending
    })
    .await
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
        r.h.fetch_answered(S0).await;
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
    async fn a_ready_from_the_holder_moves_connections_and_a_death_closes_the_ends() {
        let r = rig();
        let e0 = r.h.ends_for(S0).expect("ends of slot 0").remove(0);
        let mut c = TcpStream::connect(r.addr).expect("connect");
        r.h.ready_from_holder(S0);
        let (_, mut handed) = receive(&e0, Duration::from_secs(10)).expect("handed");
        talks(&mut c, &mut handed);
        assert_eq!(r.h.serving(), Some(S0));
        // Its reap: the task closes the shim's ends (the engine's end
        // reads the end of the stream) and hands it nothing more.
        r.h.died(S0);
        let mut buf = [0u8; 64];
        let got = nix::sys::socket::recv(e0.as_raw_fd(), &mut buf, MsgFlags::empty());
        assert_eq!(got, Ok(0), "the shim's end is closed");
        assert_eq!(r.h.serving(), None);
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
        while r.h.engine(S0).await.is_some() && std::time::Instant::now() < deadline {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        assert_eq!(r.h.engine(S0).await, None, "the dead engine is lost");
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
        r.h.fetch_answered(S0).await;
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
