//! The keeper of a pair's connections: one task, on the connection
//! thread (`owner.rs`), that owns the pair's fd store and, with
//! `shadow.dev/accept: runtime`, its listening sockets, every engine's
//! hand-off sockets, the connections waiting to be handed and
//! `shadow_pair::Connections`, which decides who is handed them.
//! Everything else tells it what happened through its inbox ([`Told`]),
//! in order, and never touches that state: the notify readers (a
//! `FDSTORE=1` or `FDSTOREREMOVE=1`, a `READY=1` sent by the lock holder),
//! the fetch servers (a fetch answered, the copies it sends), each start
//! of an engine (its fresh ends, the store's copies) and the supervisor
//! (the active engine, a death, the lock seen lost). The figures go the
//! other way, as counters the publisher reads ([`Figures`]).
//!
//! Why one task: the store's guarantees are orders. What an engine stored
//! before a fetch is in the fetch's answer: its reader tells the store
//! before the fetch asks for its copies, and the inbox keeps that order.
//! A connection is never taken from the backlog without a place in the
//! store: the acceptor is the store's owner. Nothing waits on a lock
//! another thread holds, and nothing is decided in two places.
//!
//! Why the runtime accepts: an engine that accepts a connection and is
//! killed before its `FDSTORE=1` takes that connection with it, so here
//! the shim accepts on the pair's listening sockets itself, puts each
//! connection in the store the moment it exists, and hands it to the
//! serving engine through a hand-off socket of that engine's own (the
//! protocol is `shadow_contract::handoff`'s). A respawn of a slot is
//! another engine, handed nothing until it proves it holds the lock; what
//! was handed to an engine that died is the next one's through its fetch
//! (`FdStore::copies_for`).
//!
//! The shim touches a connection once, at its accept: it never reads,
//! writes or waits on it, and an engine that does not read its hand-off
//! socket only stops its own connections from coming (they wait in the
//! store, bounded by `shadow.dev/fdstore-max`, then in the kernel's
//! backlog). Descriptors leave the keeper to be closed on the closer
//! thread, by whoever asked (a reader closes what its remove took, on its
//! engine's budget).

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
use tokio::time::Instant;

use super::fdstore::accepted::Hand;
use super::fdstore::{FdStore, Figures, Stored};
use super::fetch::{self, FetchSocket, Fetchers};
use super::input::{Input, Inputs};
use super::keeping::{Copies, Fetching, Keeping};
use super::notify::{close_off_runtime, release_now, Close};
use super::owner;
use crate::error::{Error, Result};

/// Connections accepted in one go before the inbox and the hand-offs get
/// their turn.
const ACCEPT_BATCH: usize = 64;

/// [`Keeper::serving`]'s word for "nobody".
const NOBODY: u64 = u64::MAX;

/// A hand-off socket (the shim's end), watched by the connection thread.
type End = Arc<AsyncFd<OwnedFd>>;

/// What the keeper is told: its inbox, read in order.
enum Told {
    /// The pair started: accept on these (none: the engines accept);
    /// `tx` hears when the store's figures moved.
    Start { tx: Inputs, listening: Vec<OwnedFd> },
    /// `FDSTORE=1` with descriptors, from a notify reader.
    Store {
        text: Vec<u8>,
        fds: Vec<OwnedFd>,
        reply: oneshot::Sender<Stored>,
    },
    /// `FDSTOREREMOVE=1`, from a notify reader: what it took, to close.
    Remove {
        text: Vec<u8>,
        reply: oneshot::Sender<Vec<OwnedFd>>,
    },
    /// Copies of what the store holds: for `who`'s fetch (everything is
    /// `who`'s from then on), or for an engine's start (`None`).
    CopiesFor {
        who: Option<Recipient>,
        reply: oneshot::Sender<Copies>,
    },
    /// A fetch was answered with this many descriptors.
    Fetched(usize),
    /// A fetch was refused.
    FetchRefused,
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
    ReadyFromHolder { slot: SlotId, read_at: Instant },
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

#[async_trait]
impl Keeping for Keeper {
    fn start(self: Arc<Self>, tx: &Inputs, fetching: Fetching) {
        let sockets = self
            .fetch
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
            .unwrap_or_default();
        let fetchers = Arc::new(Fetchers {
            id: self.id.clone(),
            keeper: self.clone(),
            host: fetching.host,
            notify: fetching.notify,
        });
        let mut servers = Vec::with_capacity(sockets.len());
        for (i, sock) in sockets.into_iter().enumerate() {
            let Some(slot) = SlotId::new(i) else { break };
            match fetch::serve(slot, sock, fetchers.clone()) {
                Ok(task) => servers.push(task),
                Err(e) => log::warn!(
                    "pair {}: slot {slot}'s fd store socket not served: {e}",
                    self.id
                ),
            }
        }
        self.servers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend(servers);
        self.start_accepting(tx)
    }
    fn hands(&self) -> bool {
        Keeper::hands(self)
    }
    async fn store(&self, text: Vec<u8>, fds: Vec<OwnedFd>) -> Stored {
        let (reply, answer) = oneshot::channel();
        match self.inbox.send(Told::Store { text, fds, reply }) {
            Ok(()) => answer.await.unwrap_or_default(),
            // The keeper ended (the pair did): nothing is kept.
            Err(back) => match back.0 {
                Told::Store { fds, .. } => Stored {
                    kept: 0,
                    refused: fds,
                    why: None,
                },
                _ => Stored::default(),
            },
        }
    }
    async fn remove(&self, text: Vec<u8>) -> Vec<OwnedFd> {
        let (reply, answer) = oneshot::channel();
        self.tell(Told::Remove { text, reply });
        answer.await.unwrap_or_default()
    }
    async fn copies_for(&self, who: Option<Recipient>) -> Copies {
        let (reply, answer) = oneshot::channel();
        self.tell(Told::CopiesFor { who, reply });
        answer.await.unwrap_or_default()
    }
    fn fetched(&self, n: usize) {
        self.tell(Told::Fetched(n));
    }
    fn fetch_refused(&self) {
        self.tell(Told::FetchRefused);
    }
    async fn fetch_answered(&self, slot: SlotId) -> Option<Recipient> {
        Keeper::fetch_answered(self, slot).await
    }
    fn ready_from_holder(&self, slot: SlotId, read_at: Instant) {
        self.tell_hands(Told::ReadyFromHolder { slot, read_at });
    }
    fn serving(&self) -> Option<SlotId> {
        Keeper::serving(self)
    }
    fn active_is(&self, now: Option<SlotId>) {
        Keeper::active_is(self, now)
    }
    fn died(&self, slot: SlotId) {
        self.tell_hands(Told::Died { slot });
    }
    fn lock_lost(&self, slot: SlotId) {
        self.tell_hands(Told::LockLost { slot });
    }
    fn stop(&self) {
        Keeper::stop(self)
    }
}

/// The keeper's handle: its inbox, and what others read of it.
pub struct Keeper {
    id: String,
    /// Each slot's fetch socket, until [`Keeping::start`] serves them.
    fetch: Mutex<Option<Vec<FetchSocket>>>,
    /// The fetch servers, from the start; they end with the keeper.
    servers: Mutex<Vec<JoinHandle<()>>>,
    /// Listening sockets the runtime accepts on (0: the engines accept).
    listeners: usize,
    inbox: mpsc::UnboundedSender<Told>,
    /// The pair's listening sockets (copies), until the pair starts.
    listening: Mutex<Option<Vec<OwnedFd>>>,
    task: Mutex<Option<JoinHandle<()>>>,
    figures: Arc<Figures>,
    /// Each engine's serial, from 1: given at its start, before the
    /// keeper hears of it.
    next_serial: AtomicU64,
    /// The slot handed connections, as the keeper last decided
    /// ([`NOBODY`]): a look for the notify readers, never a decision.
    serving: Arc<AtomicU64>,
    /// The active engine last sent to the keeper ([`NOBODY`]): the
    /// supervisor says it after every step, and only a change is worth a
    /// message to the connection thread. The supervisor is its one sender.
    active_sent: AtomicU64,
}

impl Keeper {
    /// The keeper of `store`, for a pair of `slots` engines, running from
    /// now on (the store is asked for copies at the first engine's
    /// create); once the pair started, it serves `fetch` (each slot's
    /// fetch socket, in slot order) and, with `listening` (copies of the
    /// pair's listening sockets, in their order; none: the engines
    /// accept), accepts on them.
    pub fn new(
        id: &str,
        store: FdStore,
        fetch: Vec<FetchSocket>,
        listening: Vec<OwnedFd>,
        slots: usize,
    ) -> Result<Arc<Self>> {
        let conns = owner::handle()?;
        let (inbox, rx) = mpsc::unbounded_channel();
        let serving = Arc::new(AtomicU64::new(NOBODY));
        let kept = Kept {
            id: id.to_owned(),
            store,
            tx: None,
            decided: Connections::new(),
            ends: (0..slots).map(|_| None).collect(),
            waiting: vec![VecDeque::new(); listening.len()],
            serving: serving.clone(),
        };
        let figures = kept.store.figures();
        let task = conns.spawn(kept.run(rx));
        Ok(Arc::new(Keeper {
            id: id.to_owned(),
            fetch: Mutex::new(Some(fetch)),
            servers: Mutex::new(Vec::new()),
            listeners: listening.len(),
            inbox,
            listening: Mutex::new(Some(listening)),
            task: Mutex::new(Some(task)),
            figures,
            next_serial: AtomicU64::new(1),
            serving,
            active_sent: AtomicU64::new(NOBODY),
        }))
    }

    /// The store's figures, for the publisher.
    pub fn figures(&self) -> Arc<Figures> {
        self.figures.clone()
    }

    /// Tells the keeper `told`; nothing when it has ended (the pair did).
    fn tell(&self, told: Told) {
        let _ = self.inbox.send(told);
    }

    /// Whether the runtime accepts: the one place that says whether the
    /// keeper hands connections (and so hears of proofs, deaths and who
    /// is active).
    fn hands(&self) -> bool {
        self.listeners > 0
    }

    /// [`Keeper::tell`], when the keeper hands connections; nothing else
    /// needs the news.
    fn tell_hands(&self, told: Told) {
        if self.hands() {
            self.tell(told);
        }
    }

    /// The pair started: accepts from now on, until [`Keeper::stop`]
    /// (once); `tx` hears when the store's figures moved.
    fn start_accepting(&self, tx: &Inputs) {
        let Some(listening) = self
            .listening
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        else {
            return;
        };
        self.tell(Told::Start {
            tx: tx.clone(),
            listening,
        });
    }

    /// The pair ended: no more accepts or fetches; the keeper ends, and
    /// every hand-off socket and the store with it.
    pub fn stop(&self) {
        for t in self
            .servers
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .drain(..)
        {
            t.abort();
        }
        self.fetch.lock().unwrap_or_else(|p| p.into_inner()).take();
        if let Some(t) = self.task.lock().unwrap_or_else(|p| p.into_inner()).take() {
            t.abort();
        }
        self.listening
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take();
        self.serving.store(NOBODY, Ordering::Release);
    }

    /// A copy of everything the store holds, for an engine's start.
    pub async fn copies(&self) -> Copies {
        Keeping::copies_for(self, None).await
    }

    /// A new engine of `slot` starts: its ends of fresh hand-off sockets,
    /// one per listener, for its `LISTEN_FDS` (blocking, as engines
    /// expect); the shim's ends replace the slot's previous engine's. The
    /// new engine serves only once it proves it holds the lock. None when
    /// the engines accept.
    pub fn ends_for(&self, slot: SlotId) -> Result<Vec<OwnedFd>> {
        if !self.hands() {
            return Ok(Vec::new());
        }
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
    /// what waits). That engine, once the keeper has taken it in.
    pub async fn fetch_answered(&self, slot: SlotId) -> Option<Recipient> {
        if !self.hands() {
            return None;
        }
        let (reply, answer) = oneshot::channel();
        self.tell(Told::FetchAnswered { slot, reply });
        answer.await.ok().flatten()
    }

    /// The supervisor's active engine now: sent to the keeper when it
    /// changed since the last one sent (what a change means is the
    /// decision's, `ConnEvent::Active`).
    pub fn active_is(&self, now: Option<SlotId>) {
        if !self.hands() {
            return;
        }
        let word = now.map_or(NOBODY, |s| s.index() as u64);
        if self.active_sent.swap(word, Ordering::AcqRel) != word {
            self.tell(Told::Active(now));
        }
    }

    /// The slot handed connections now, as the keeper last decided.
    pub fn serving(&self) -> Option<SlotId> {
        match self.serving.load(Ordering::Acquire) {
            NOBODY => None,
            n => usize::try_from(n).ok().and_then(SlotId::new),
        }
    }

    #[cfg(test)]
    /// The engine now in `slot`, as the keeper knows it.
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

/// The keeper's state: its alone.
struct Kept {
    id: String,
    store: FdStore,
    /// Told the store's figures moved; from the pair's start.
    tx: Option<Inputs>,
    /// Who is handed connections: the one place that says it.
    decided: Connections,
    /// Per slot: its current engine's ends.
    ends: Vec<Option<Ends>>,
    /// Per listener: the store's tokens of connections not handed yet, in
    /// the order they were accepted.
    waiting: Vec<VecDeque<u64>>,
    serving: Arc<AtomicU64>,
}

impl Kept {
    async fn run(mut self, mut inbox: mpsc::UnboundedReceiver<Told>) {
        // The store's hang-ups, on its own epoll (systemd's `FDPOLL`):
        // data arriving for an engine never wakes the shim.
        let hangups = match self.watch_hangups() {
            Ok(h) => Some(h),
            Err(e) => {
                log::warn!("pair {}: fd store: hang-ups not watched: {e}", self.id);
                None
            }
        };
        let mut listeners: Vec<AsyncFd<OwnedFd>> = Vec::new();
        // Where the look for a readable listener starts: each in turn, so
        // that a flood on one does not starve the others.
        let mut first = 0;
        loop {
            let blocked: Vec<End> = (0..listeners.len())
                .filter_map(|i| self.hand_waiting(i))
                .collect();
            let has_room = self.store.has_room();
            if !has_room {
                self.store.watch_handed();
            }
            self.nudge();
            let told = tokio::select! {
                // What it is told first: a proof moves connections before
                // more are accepted for nobody, and a store datagram is in
                // before the fetch that follows it.
                biased;
                told = inbox.recv() => match told {
                    Some(told) => Some(told),
                    None => return,
                },
                ready = watched(hangups.as_ref()) => {
                    match ready {
                        Ok(mut ready) => {
                            let gone = self.store.hung_up();
                            ready.clear_ready();
                            if !gone.is_empty() {
                                log::debug!("pair {}: fd store: {} hung up", self.id, gone.len());
                                tokio::spawn(close_off_runtime(gone, Close::Release));
                            }
                        }
                        Err(e) => {
                            log::warn!("pair {}: fd store: hang-ups are no longer watched: {e}", self.id);
                            return;
                        }
                    }
                    None
                }
                (index, ready) = readable(&listeners, first), if has_room && !listeners.is_empty() => {
                    let Ok(mut ready) = ready else {
                        log::warn!("pair {}: listening socket {index} is no longer watched", self.id);
                        return;
                    };
                    first = (index + 1) % listeners.len();
                    if self.accept_some(index, listeners[index].get_ref().as_fd()) {
                        ready.clear_ready();
                    }
                    None
                }
                ready = writable(&blocked), if !blocked.is_empty() => {
                    if let Ok(mut ready) = ready {
                        ready.clear_ready();
                    }
                    None
                }
            };
            match told {
                Some(Told::Start { tx, listening }) => {
                    self.tx = Some(tx);
                    match watch_listeners(listening) {
                        Ok(l) => listeners = l,
                        Err(e) => log::error!("pair {}: the runtime does not accept: {e}", self.id),
                    }
                }
                Some(told) => self.take(told),
                None => {}
            }
        }
    }

    /// The store's epoll, watched by the connection thread's reactor.
    fn watch_hangups(&self) -> Result<AsyncFd<OwnedFd>> {
        let fd = self
            .store
            .epoll_fd()
            .try_clone_to_owned()
            .map_err(|e| Error::io("copying the fd store's epoll descriptor", e))?;
        // SAFETY: the AsyncFd owns `fd` (an OwnedFd, a copy of the
        // epoll's) and neither closes nor replaces it while registered; it
        // is closed when the AsyncFd drops.
        unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }
            .map_err(|e| Error::io("watching the fd store's epoll", e.into()))
    }

    /// The supervisor hears of the first move of the store's figures since
    /// its publisher last looked (it republishes within
    /// `publish::COUNTERS_EVERY`); a full queue has it busy anyway.
    fn nudge(&mut self) {
        if self.store.take_nudge() {
            if let Some(tx) = &self.tx {
                let _ = tx.try_send(Input::StoreMoved);
            }
        }
    }

    /// Takes in what it was told.
    fn take(&mut self, told: Told) {
        let event = match told {
            Told::Start { .. } => return,
            Told::Store { text, fds, reply } => {
                let out = self.store.store(&text, fds);
                if let Err(out) = reply.send(out) {
                    // The reader is gone (the pair ends): what was not
                    // kept is closed off this thread.
                    release_now(out.refused);
                }
                return;
            }
            Told::Remove { text, reply } => {
                let gone = self.store.remove(&text);
                if let Err(gone) = reply.send(gone) {
                    release_now(gone);
                }
                return;
            }
            Told::CopiesFor { who, reply } => {
                let copies = self.store.copies_for(who);
                if let Err(copies) = reply.send(copies) {
                    release_now(copies.into_iter().map(|(_, fd)| fd).collect());
                }
                return;
            }
            Told::Fetched(n) => {
                self.store.fetched(n);
                return;
            }
            Told::FetchRefused => {
                self.store.fetch_refused();
                return;
            }
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
            Told::ReadyFromHolder { slot, read_at } => {
                let Some(r) = self.decided.engine(slot) else {
                    return;
                };
                let event = ConnEvent::ReadyFromHolder {
                    slot,
                    serial: r.serial,
                };
                let read = read_at.elapsed().as_secs_f64() * 1e3;
                self.decide_saying(event, &format!(", {read:.3} ms after it was read"));
                return;
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
        self.decide_saying(event, "");
    }

    /// [`Kept::decide`], the log of a move ending with `more`. A move to
    /// an engine is said at info (once or twice a failover: which proof
    /// moved the connections, and when, is the runtime's share of it).
    fn decide_saying(&mut self, event: ConnEvent, more: &str) {
        if !self.decided.handle(event) {
            return;
        }
        let now = self.decided.recipient();
        match now {
            Some(r) => log::info!(
                "pair {}: connections go to slot {} ({event:?}{more})",
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
            let sent = self.store.hand(token, who, |name, conn| {
                send(sock.get_ref().as_fd(), name, conn)
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
    /// the listener has none left (its readiness is spent). An accept is
    /// made only while the store has room: a connection is never taken
    /// from the backlog without a place in the store.
    fn accept_some(&mut self, index: usize, listener: BorrowedFd<'_>) -> bool {
        for _ in 0..ACCEPT_BATCH {
            if !self.store.has_room() {
                return false;
            }
            // Blocking and close-on-exec: the engine that is handed it
            // gets the connection as its own accept would have made it.
            let conn = match accept4(listener.as_raw_fd(), SockFlag::SOCK_CLOEXEC) {
                // SAFETY: accept4 just returned this descriptor; it is
                // owned here and nowhere else.
                Ok(raw) => unsafe { OwnedFd::from_raw_fd(raw) },
                Err(nix::errno::Errno::EAGAIN) => return true,
                Err(nix::errno::Errno::EINTR | nix::errno::Errno::ECONNABORTED) => continue,
                // Out of descriptors, or memory: this round ends; the next
                // readiness tries again.
                Err(e) => {
                    log::warn!("pair {}: accept on listening socket {index}: {e}", self.id);
                    return true;
                }
            };
            match self.store.accept(index, conn) {
                Ok(token) => self.waiting[index].push_back(token),
                // Room was there a moment ago, on this same task: not
                // reached; the connection is let go rather than lost.
                Err(conn) => {
                    release_now(vec![conn]);
                    return false;
                }
            }
        }
        false
    }
}

/// The pair's listening sockets (copies), watched by the connection
/// thread's reactor.
fn watch_listeners(listening: Vec<OwnedFd>) -> Result<Vec<AsyncFd<OwnedFd>>> {
    let mut listeners = Vec::with_capacity(listening.len());
    for fd in listening {
        // This copy's open file is the pair's one listening socket, and no
        // engine has it in this mode: non-blocking is the shim's own.
        set_nonblocking(&fd, "a listening socket")?;
        // SAFETY: the AsyncFd owns `fd` (an OwnedFd) and neither closes
        // nor replaces it while registered.
        let listener = unsafe { AsyncFd::register_with_interest(fd, Interest::READABLE) }
            .map_err(|e| Error::io("watching a listening socket", e.into()))?;
        listeners.push(listener);
    }
    Ok(listeners)
}

/// `fd` readable; never, when there is none.
async fn watched(
    fd: Option<&AsyncFd<OwnedFd>>,
) -> std::io::Result<tokio::io::unix::AsyncFdReadyGuard<'_, OwnedFd>> {
    match fd {
        Some(fd) => fd.readable().await,
        None => std::future::pending().await,
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
    use crate::pair::input;
    use shadow_contract::state::FdStoreStatus;

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
        h: Arc<Keeper>,
        figures: Arc<Figures>,
        addr: std::net::SocketAddr,
        inputs: tokio::sync::mpsc::Receiver<input::Input>,
    }

    /// A keeper of a store of 16, the runtime accepting on one listener.
    fn rig() -> Rig {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("address");
        let store = FdStore::new(16).expect("store");
        let h =
            Keeper::new("t", store, Vec::new(), vec![OwnedFd::from(listener)], 2).expect("keeper");
        let (tx, rx) = input::channel();
        h.start_accepting(&tx);
        Rig {
            figures: h.figures(),
            h,
            addr,
            inputs: rx,
        }
    }

    /// `f` of the figures, once it holds (the keeper counts on its thread).
    fn eventually(figures: &Figures, what: &str, f: impl Fn(&FdStoreStatus) -> bool) {
        shadow_wait::until(
            what,
            Duration::from_secs(10),
            Duration::from_millis(2),
            || Some(()).filter(|_| f(&figures.status())),
        );
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
        eventually(&r.figures, "one accepted", |s| s.accepted == 1);
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
        eventually(&r.figures, "two handed", |s| s.handed == 2);
        r.h.stop();
    }

    #[tokio::test]
    async fn a_ready_from_the_holder_moves_connections_and_a_death_closes_the_ends() {
        let r = rig();
        let e0 = r.h.ends_for(S0).expect("ends of slot 0").remove(0);
        let mut c = TcpStream::connect(r.addr).expect("connect");
        r.h.ready_from_holder(S0, tokio::time::Instant::now());
        let (_, mut handed) = receive(&e0, Duration::from_secs(10)).expect("handed");
        talks(&mut c, &mut handed);
        assert_eq!(r.h.serving(), Some(S0));
        // Its reap: the keeper closes the shim's ends (the engine's end
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

    fn memfd(name: &str) -> OwnedFd {
        nix::sys::memfd::memfd_create(name, nix::sys::memfd::MFdFlags::MFD_CLOEXEC).expect("memfd")
    }

    /// The store's one owner: what a reader stored is in the copies asked
    /// after it, in order; a remove hands back what it took; the
    /// publisher's figures follow, and the supervisor hears of the first
    /// move since they were read, once.
    #[tokio::test]
    async fn stores_removes_and_copies_go_through_the_keeper_in_order() {
        let mut r = rig();
        let kept =
            r.h.store(b"FDSTORE=1\nFDNAME=a\n".to_vec(), vec![memfd("a")])
                .await;
        assert_eq!((kept.kept, kept.refused.len()), (1, 0));
        let (s, _c) = {
            let l = TcpListener::bind("127.0.0.1:0").expect("bind");
            let c = TcpStream::connect(l.local_addr().expect("address")).expect("connect");
            (l.accept().expect("accept").0, c)
        };
        r.h.store(b"FDSTORE=1\nFDNAME=b\n".to_vec(), vec![OwnedFd::from(s)])
            .await;
        let names: Vec<String> = r.h.copies().await.into_iter().map(|(n, _)| n).collect();
        assert_eq!(names, ["a", "b"]);
        // Something neither a socket nor a memfd comes back, refused.
        let (pipe, _w) = nix::unistd::pipe().expect("pipe");
        let refused =
            r.h.store(b"FDSTORE=1\nFDNAME=c\n".to_vec(), vec![pipe])
                .await;
        assert_eq!((refused.kept, refused.refused.len()), (0, 1));
        let gone = r.h.remove(b"FDSTOREREMOVE=1\nFDNAME=a\n".to_vec()).await;
        assert_eq!(gone.len(), 1);
        let s = r.figures.status();
        assert_eq!((s.fds, s.stored, s.removed), (1, 2, 1));
        assert_eq!(s.refused["wrong_type"], 1);
        // One nudge for all of it: nobody read the figures meanwhile.
        let got = tokio::time::timeout(Duration::from_secs(5), r.inputs.recv()).await;
        assert!(matches!(got, Ok(Some(input::Input::StoreMoved))), "{got:?}");
        let more = tokio::time::timeout(Duration::from_millis(50), r.inputs.recv()).await;
        assert!(more.is_err(), "{more:?}");
        // Read: the next move is told again.
        assert!(r.figures.take_moved());
        r.h.fetch_refused();
        let got = tokio::time::timeout(Duration::from_secs(5), r.inputs.recv()).await;
        assert!(matches!(got, Ok(Some(input::Input::StoreMoved))), "{got:?}");
        assert_eq!(r.figures.status().fetches_refused, 1);
        r.h.stop();
    }

    /// A stored socket whose peer hung up leaves the store on the keeper's
    /// own watch; the engines' accepting pair hands nothing.
    #[tokio::test]
    async fn the_keeper_drops_hung_up_sockets_and_an_engines_accepting_pair_hands_nothing() {
        let h = Keeper::new(
            "t",
            FdStore::new(4).expect("store"),
            Vec::new(),
            Vec::new(),
            2,
        )
        .expect("keeper");
        let (tx, _rx) = input::channel();
        h.start_accepting(&tx);
        assert!(!h.hands());
        assert!(h.ends_for(S0).expect("no ends").is_empty());
        assert_eq!(h.fetch_answered(S0).await, None);
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let c = TcpStream::connect(l.local_addr().expect("address")).expect("connect");
        let (s, _) = l.accept().expect("accept");
        h.store(
            b"FDSTORE=1\nFDNAME=conn\n".to_vec(),
            vec![OwnedFd::from(s.try_clone().expect("dup"))],
        )
        .await;
        s.shutdown(std::net::Shutdown::Write).expect("shutdown");
        drop((s, c));
        let figures = h.figures();
        eventually(&figures, "the hung-up socket dropped", |s| {
            s.hung_up == 1 && s.fds == 0
        });
        assert!(h.copies().await.is_empty());
        h.stop();
    }
}
