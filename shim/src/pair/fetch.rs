//! The fd store's fetch sockets: a promoted engine is already running, so
//! it cannot be handed the store at its start as systemd hands it to a
//! restarted service; it fetches it instead, right after it takes the
//! election lock. One `SOCK_SEQPACKET` socket per slot, bound in the pair
//! directory and seen by that slot's engine alone at
//! `SHADOW_FDSTORE_SOCKET` (the protocol is `shadow_contract::fdstore`'s).
//!
//! A fetch is answered for the lock holder only, as `READY=1` is believed
//! only from it: the connecting process (`SO_PEERCRED`) must be in the
//! slot's engine and that engine must hold the lock. Before it is
//! answered, every notify socket of the pair is read up to the fetch, and
//! each reader has told the keeper (`keeper.rs`, the store's owner) what
//! it read before the fetch asks it for its copies: the keeper's inbox
//! keeps that order, so what the dead engine stored just before it died
//! is in the answer. One
//! fetch per slot at a time, each bounded in time; sends never block the
//! runtime (a fetcher that does not read is dropped at the deadline).

use std::io::IoSlice;
use std::os::fd::{AsFd, AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use nix::sys::socket::{
    accept4, bind, getsockopt, listen, sendmsg, socket, sockopt, AddressFamily, Backlog,
    ControlMessage, MsgFlags, SockFlag, SockType, UnixAddr,
};
use shadow_contract::fdstore::FDS_PER_PACKET;
use shadow_pair::SlotId;
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;
use tokio::sync::Semaphore;
use tokio::task::JoinHandle;
use tokio::time::Instant;

use super::host::Host;
use super::keeping::Keeping;
use super::lock::LockSeen;
use super::notify::{close_off_runtime, Close, NotifySocket};
use super::owner;
use crate::error::{Error, Result};

/// The longest a fetch may take, from its connection to its last packet.
const FETCH_DEADLINE: Duration = Duration::from_secs(10);
/// The longest a fetch waits for the notify sockets to be read up to it.
const DRAIN_WAIT: Duration = Duration::from_millis(200);
/// The drain's first looks: each after the connection thread has read
/// what its sockets hold (a yield runs the reactor and the readers, which
/// share this thread), a few microseconds apiece.
const DRAIN_YIELDS: u32 = 64;
/// How often the drain looks after those, should an engine keep its
/// socket busy (a flood is not waited out on a spinning thread).
const DRAIN_LOOK: Duration = Duration::from_millis(1);

/// One slot's fetch socket, listening.
pub struct FetchSocket {
    fd: OwnedFd,
}

impl FetchSocket {
    /// Bound at `path` (a stale file replaced), world-connectable so that
    /// an engine running as any user can fetch; non-blocking.
    pub fn bind(path: &Path) -> Result<FetchSocket> {
        let _ = std::fs::remove_file(path);
        let fd = socket(
            AddressFamily::Unix,
            SockType::SeqPacket,
            SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
            None,
        )
        .map_err(|e| Error::sys("socket(AF_UNIX, SOCK_SEQPACKET) for the fd store", e))?;
        let addr = UnixAddr::new(path).map_err(|e| Error::sys(format!("{}", path.display()), e))?;
        bind(fd.as_raw_fd(), &addr)
            .map_err(|e| Error::sys(format!("binding fd store socket {}", path.display()), e))?;
        listen(&fd, Backlog::new(8).unwrap_or(Backlog::MAXCONN))
            .map_err(|e| Error::sys(format!("listen on {}", path.display()), e))?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666))
            .map_err(|e| Error::io(format!("chmod fd store socket {}", path.display()), e))?;
        Ok(FetchSocket { fd })
    }
}

/// What the fetch servers of a pair share.
pub struct Fetchers {
    pub id: String,
    /// The store's owner: it answers with copies, and (the runtime
    /// accepting) hands the fetcher connections from then on, never again
    /// what it was handed.
    pub keeper: Arc<dyn Keeping>,
    pub host: Arc<dyn Host>,
    /// Every slot's notify socket, read up to a fetch before it is answered.
    pub notify: Vec<Arc<NotifySocket>>,
}

/// Serve `slot`'s fetch socket until the keeper that started it ends it.
pub fn serve(slot: SlotId, sock: FetchSocket, shared: Arc<Fetchers>) -> Result<JoinHandle<()>> {
    // Served on the connection thread (`owner.rs`): a takeover's fetch
    // waits for nothing the supervisor does.
    let conns = owner::handle()?;
    let _on_conns = conns.enter();
    // SAFETY: the AsyncFd owns the listening socket (an OwnedFd) and
    // neither closes nor replaces it while registered.
    let listener = unsafe { AsyncFd::register_with_interest(sock.fd, Interest::READABLE) }
        .map_err(|e| Error::io("watching the fd store socket", e.into()))?;
    let one_at_a_time = Arc::new(Semaphore::new(1));
    Ok(conns.spawn(async move {
        loop {
            let Ok(mut ready) = listener.readable().await else {
                return;
            };
            let conn = match accept4(
                listener.get_ref().as_raw_fd(),
                SockFlag::SOCK_CLOEXEC | SockFlag::SOCK_NONBLOCK,
            ) {
                // SAFETY: accept4 just returned this descriptor; it is
                // owned here and nowhere else.
                Ok(raw) => unsafe { OwnedFd::from_raw_fd(raw) },
                Err(nix::errno::Errno::EAGAIN) => {
                    ready.clear_ready();
                    continue;
                }
                // A peer that went away, or out of descriptors: that one
                // fetch is lost, the socket goes on.
                Err(e) => {
                    log::warn!(
                        "pair {}: fd store socket of slot {slot}: accept: {e}",
                        shared.id
                    );
                    tokio::time::sleep(Duration::from_millis(10)).await;
                    continue;
                }
            };
            let Ok(permit) = one_at_a_time.clone().try_acquire_owned() else {
                shared.keeper.fetch_refused();
                refuse(conn, "a fetch of this slot is already being answered").await;
                continue;
            };
            let shared = shared.clone();
            tokio::spawn(async move {
                let _permit = permit;
                let deadline = Instant::now() + FETCH_DEADLINE;
                let done = tokio::time::timeout_at(deadline, answer(slot, conn, &shared)).await;
                if done.is_err() {
                    log::warn!(
                        "pair {}: a fetch of the fd store by slot {slot} did not finish within {FETCH_DEADLINE:?}: dropped",
                        shared.id
                    );
                }
            });
        }
    }))
}

/// One packet, sent whole or not at all; waits for room (the caller
/// bounds the wait).
async fn send(conn: &AsyncFd<OwnedFd>, text: &str, fds: &[RawFd]) -> std::io::Result<()> {
    loop {
        let mut ready = conn.writable().await?;
        let rights = [ControlMessage::ScmRights(fds)];
        let cmsgs: &[ControlMessage<'_>] = if fds.is_empty() { &[] } else { &rights };
        match sendmsg::<()>(
            conn.get_ref().as_raw_fd(),
            &[IoSlice::new(text.as_bytes())],
            cmsgs,
            MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_NOSIGNAL,
            None,
        ) {
            Ok(_) => return Ok(()),
            Err(nix::errno::Errno::EAGAIN) => ready.clear_ready(),
            Err(e) => return Err(e.into()),
        }
    }
}

async fn refuse(conn: OwnedFd, why: &str) {
    // SAFETY: the AsyncFd owns the connection (an OwnedFd) until
    // `into_inner` gives it back; nothing closes or replaces it meanwhile.
    if let Ok(conn) = unsafe { AsyncFd::register_with_interest(conn, Interest::WRITABLE) } {
        let _ = tokio::time::timeout(
            Duration::from_millis(100),
            send(&conn, &format!("ERROR={why}\n"), &[]),
        )
        .await;
        close_off_runtime(vec![conn.into_inner()], Close::Release).await;
    }
}

/// Whether `pid` (the connecting process) may fetch for `slot`: why not.
/// The lock is proven first from the fetcher's own descriptors (no
/// `/proc/locks` read, whose grace period the takeover would wait out),
/// else by `/proc/locks`.
async fn refusal(slot: SlotId, pid: Option<i32>, host: &dyn Host) -> Option<String> {
    let Some(pid) = pid.filter(|p| *p > 0) else {
        return Some("the connecting process has no pid here".into());
    };
    if host.slot_of_pid(pid as u32) != Some(slot) {
        return Some(format!("pid {pid} is not an engine of slot {slot}"));
    }
    if host.lock_held_by(pid as u32) == Some(true) {
        return None;
    }
    match host.lock().await.seen {
        LockSeen::Held(s) if s == slot => None,
        LockSeen::Held(s) => Some(format!(
            "slot {slot} does not hold the election lock (slot {s} does): only the serving engine fetches the store"
        )),
        LockSeen::Free => Some(format!(
            "slot {slot} does not hold the election lock (nobody does): take the lock first"
        )),
        LockSeen::Unknown => Some("the election lock's holder cannot be told now".into()),
    }
}

async fn answer(slot: SlotId, conn: OwnedFd, shared: &Fetchers) {
    let pid = getsockopt(&conn, sockopt::PeerCredentials)
        .ok()
        .map(|c| c.pid());
    if let Some(why) = refusal(slot, pid, shared.host.as_ref()).await {
        shared.keeper.fetch_refused();
        log::warn!("pair {}: fd store fetch refused: {why}", shared.id);
        refuse(conn, &why).await;
        return;
    }
    // The lock holder serves: new connections go to it at once.
    let who = shared.keeper.fetch_answered(slot).await;
    // Everything sent to the notify sockets before this fetch is told to
    // the keeper once each socket has been seen with nothing unread: a
    // reader tells it in the same step as its read.
    let asked = Instant::now();
    let until = asked + DRAIN_WAIT;
    let mut read_up = vec![false; shared.notify.len()];
    let mut looks = 0;
    loop {
        for (seen, sock) in read_up.iter_mut().zip(&shared.notify) {
            *seen = *seen || !sock.has_unread();
        }
        if read_up.iter().all(|s| *s) || Instant::now() >= until {
            break;
        }
        looks += 1;
        if looks <= DRAIN_YIELDS {
            tokio::task::yield_now().await;
        } else {
            tokio::time::sleep(DRAIN_LOOK).await;
        }
    }
    let drained = asked.elapsed();
    let copies = shared.keeper.copies_for(who).await;
    let total = copies.len();
    // SAFETY: as in `refuse`: the AsyncFd owns the connection until
    // `into_inner`.
    let Ok(conn) = (unsafe { AsyncFd::register_with_interest(conn, Interest::WRITABLE) }) else {
        close_off_runtime(
            copies.into_iter().map(|(_, fd)| fd).collect(),
            Close::Release,
        )
        .await;
        return;
    };
    let mut sent = Ok(());
    for batch in copies.chunks(FDS_PER_PACKET) {
        let names: Vec<&str> = batch.iter().map(|(n, _)| n.as_str()).collect();
        let fds: Vec<RawFd> = batch.iter().map(|(_, fd)| fd.as_fd().as_raw_fd()).collect();
        sent = send(&conn, &format!("FDNAMES={}\n", names.join(":")), &fds).await;
        if sent.is_err() {
            break;
        }
    }
    if sent.is_ok() {
        sent = send(&conn, &format!("END={total}\n"), &[]).await;
    }
    match sent {
        Ok(()) => {
            shared.keeper.fetched(total);
            log::info!(
                "pair {}: slot {slot} fetched the fd store ({total} descriptors; the notify sockets read up in {:.1} ms, answered in {:.1} ms)",
                shared.id,
                drained.as_secs_f64() * 1e3,
                asked.elapsed().as_secs_f64() * 1e3
            );
        }
        Err(e) => log::warn!("pair {}: answering slot {slot}'s fetch: {e}", shared.id),
    }
    // Our copies: the engine has its own now (in flight until it reads
    // them); the store keeps its.
    let mut mine: Vec<OwnedFd> = copies.into_iter().map(|(_, fd)| fd).collect();
    mine.push(conn.into_inner());
    close_off_runtime(mine, Close::Release).await;
}

#[cfg(test)]
mod tests {
    //! A fetch over a real socket: the fetch socket bound in a temp dir,
    //! the fetcher connecting as an engine does, the descriptors received
    //! with `SCM_RIGHTS`; a fake machine says who holds the lock.

    use std::io::IoSliceMut;
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
    use std::sync::Mutex;

    use async_trait::async_trait;
    use nix::sys::signal::Signal;
    use nix::sys::socket::{connect, recvmsg, ControlMessageOwned};

    use super::*;
    use crate::pair::fdstore::FdStore;
    use crate::pair::host::{Passing, ReapFuture};
    use crate::pair::input;
    use crate::pair::keeper::Keeper;
    use crate::pair::keeping::Fetching;
    use crate::pair::lock::LockLook;

    const S0: SlotId = SlotId::ZERO;
    const S1: SlotId = SlotId::ONE;

    /// This process is the engine of slot 0; `holder` holds the lock, as
    /// its fdinfo (`fast`) or `/proc/locks` would say.
    struct Machine {
        holder: LockSeen,
        fast: Option<bool>,
        looks: Mutex<u32>,
    }

    #[async_trait]
    impl Host for Machine {
        async fn create(&self, _slot: SlotId, _give: &dyn Passing) -> Result<u32> {
            Ok(0)
        }
        async fn spawn(&self, _slot: SlotId, _give: &dyn Passing) -> Result<u32> {
            Ok(0)
        }
        async fn end_created(&self, _slot: SlotId) {}
        async fn remove(&self, _slot: SlotId) {}
        async fn ps(&self, _slot: SlotId) -> Result<Vec<u32>> {
            Ok(Vec::new())
        }
        fn reaped(&self, _pid: u32) -> ReapFuture {
            Box::pin(std::future::pending())
        }
        fn signal(&self, _pid: u32, _signal: Signal) {}
        fn slot_of_pid(&self, pid: u32) -> Option<SlotId> {
            (pid == std::process::id()).then_some(S0)
        }
        async fn lock(&self) -> LockLook {
            *self.looks.lock().unwrap_or_else(|p| p.into_inner()) += 1;
            LockLook {
                seen: self.holder,
                ..LockLook::UNKNOWN
            }
        }
        fn lock_held_by(&self, _pid: u32) -> Option<bool> {
            self.fast
        }
        fn oom_kills(&self, _slot: SlotId) -> u64 {
            0
        }
        async fn kill_rest(&self, _slot: SlotId) {}
        fn kill_engine(&self, _slot: SlotId, _pid: Option<u32>) {}
        fn close_listen(&self) {}
    }

    /// Every packet of one fetch: its text and descriptors, to the end.
    fn fetch(path: &Path) -> Vec<(String, Vec<OwnedFd>)> {
        let sock = socket(
            AddressFamily::Unix,
            SockType::SeqPacket,
            SockFlag::SOCK_CLOEXEC,
            None,
        )
        .expect("socket");
        connect(sock.as_raw_fd(), &UnixAddr::new(path).expect("address")).expect("connect");
        let tv = nix::sys::time::TimeVal::new(10, 0);
        nix::sys::socket::setsockopt(&sock, sockopt::ReceiveTimeout, &tv).expect("timeout");
        let mut packets = Vec::new();
        loop {
            let mut buf = [0u8; 1024];
            let mut iov = [IoSliceMut::new(&mut buf)];
            let mut space = nix::cmsg_space!([RawFd; FDS_PER_PACKET]);
            let msg = recvmsg::<()>(
                sock.as_raw_fd(),
                &mut iov,
                Some(&mut space),
                MsgFlags::empty(),
            )
            .expect("recvmsg");
            if msg.bytes == 0 {
                return packets;
            }
            let mut fds = Vec::new();
            for c in msg.cmsgs().expect("cmsgs") {
                if let ControlMessageOwned::ScmRights(got) = c {
                    // SAFETY: SCM_RIGHTS just installed these descriptors
                    // in this process; each is owned here only.
                    fds.extend(
                        got.into_iter()
                            .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }),
                    );
                }
            }
            let bytes = msg.bytes;
            let text = String::from_utf8_lossy(&buf[..bytes]).into_owned();
            let last = text.starts_with("END=") || text.starts_with("ERROR=");
            packets.push((text, fds));
            if last {
                return packets;
            }
        }
    }

    fn memfd(name: &str) -> OwnedFd {
        nix::sys::memfd::memfd_create(name, nix::sys::memfd::MFdFlags::MFD_CLOEXEC).expect("memfd")
    }

    /// The fetch socket of slot 0 served; what the test keeps alive.
    struct Served {
        _dir: tempfile::TempDir,
        path: std::path::PathBuf,
        host: Arc<Machine>,
        keeper: Arc<Keeper>,
        _inputs: tokio::sync::mpsc::Receiver<input::Input>,
    }

    async fn serving(host: Machine) -> Served {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("fdstore.sock");
        let mut store = FdStore::new(16).expect("store");
        store.store(b"FDSTORE=1\nFDNAME=a\n", vec![memfd("a")]);
        store.store(b"FDSTORE=1\nFDNAME=b\n", vec![memfd("b")]);
        // Slot 0's fetch socket, served by the keeper from its start.
        let sock = FetchSocket::bind(&path).expect("bind");
        let keeper = Keeper::new("t", store, vec![sock], Vec::new(), 2).expect("keeper");
        let host = Arc::new(host);
        let (tx, rx) = input::channel();
        let fetching = Fetching {
            host: host.clone(),
            notify: Vec::new(),
        };
        keeper.clone().start(&tx, fetching);
        Served {
            _dir: dir,
            path,
            host,
            keeper,
            _inputs: rx,
        }
    }

    #[tokio::test]
    async fn the_lock_holder_fetches_everything_without_a_proc_locks_read() {
        let Served {
            path, host, keeper, ..
        } = &serving(Machine {
            holder: LockSeen::Held(S0),
            fast: Some(true),
            looks: Mutex::new(0),
        })
        .await;
        let path = path.clone();
        let packets = tokio::task::spawn_blocking(move || fetch(&path))
            .await
            .expect("fetcher");
        let (names, fds): (Vec<_>, Vec<_>) = packets.into_iter().unzip();
        assert_eq!(names, ["FDNAMES=a:b\n", "END=2\n"]);
        assert_eq!(fds.iter().map(Vec::len).collect::<Vec<_>>(), [2, 0]);
        assert_eq!(*host.looks.lock().unwrap_or_else(|p| p.into_inner()), 0);
        // Counted by the keeper once the answer is out.
        let figures = keeper.figures();
        shadow_wait::until(
            "the fetch counted",
            Duration::from_secs(10),
            Duration::from_millis(2),
            || {
                let s = figures.status();
                Some(()).filter(|_| (s.fetches, s.fetched, s.fds) == (1, 2, 2))
            },
        );
    }

    #[tokio::test]
    async fn proc_locks_proves_what_the_descriptors_cannot_and_refuses_a_non_holder() {
        let Served { path, host, .. } = &serving(Machine {
            holder: LockSeen::Held(S0),
            fast: None,
            looks: Mutex::new(0),
        })
        .await;
        let path = path.clone();
        let packets = tokio::task::spawn_blocking(move || fetch(&path))
            .await
            .expect("fetcher");
        assert_eq!(packets.last().map(|p| p.0.as_str()), Some("END=2\n"));
        assert_eq!(*host.looks.lock().unwrap_or_else(|p| p.into_inner()), 1);

        let refusing = serving(Machine {
            holder: LockSeen::Held(S1),
            fast: Some(false),
            looks: Mutex::new(0),
        })
        .await;
        let path = refusing.path.clone();
        let packets = tokio::task::spawn_blocking(move || fetch(&path))
            .await
            .expect("fetcher");
        assert_eq!(packets.len(), 1);
        assert!(
            packets[0]
                .0
                .starts_with("ERROR=slot 0 does not hold the election lock (slot 1 does)"),
            "{:?}",
            packets[0].0
        );
        assert!(packets[0].1.is_empty(), "nothing handed to a non-holder");
        let figures = refusing.keeper.figures();
        shadow_wait::until(
            "the refusal counted",
            Duration::from_secs(10),
            Duration::from_millis(2),
            || Some(()).filter(|_| figures.status().fetches_refused == 1),
        );
    }
}
