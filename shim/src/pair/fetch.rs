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
//! answered, every notify socket of the pair is read up to the fetch, so
//! what the dead engine stored just before it died is in the answer. One
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

use super::fdstore::{self, Shared};
use super::handoff::Handoff;
use super::host::Host;
use super::input::Inputs;
use super::lock::LockSeen;
use super::notify::{close_off_runtime, Close, NotifySocket};
use super::owner;
use crate::error::{Error, Result};

/// The longest a fetch may take, from its connection to its last packet.
const FETCH_DEADLINE: Duration = Duration::from_secs(10);
/// The longest a fetch waits for the notify sockets to be read up to it.
const DRAIN_WAIT: Duration = Duration::from_millis(200);
/// How often the drain looks again.
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
    pub store: Shared,
    pub host: Arc<dyn Host>,
    /// Every slot's notify socket, read up to a fetch before it is answered.
    pub notify: Vec<Arc<NotifySocket>>,
    /// To nudge the supervisor when the store's figures moved.
    pub tx: Inputs,
    /// With `shadow.dev/accept: runtime`: the fetcher serves from now on,
    /// and is not given again what it was handed.
    pub handoff: Option<Arc<Handoff>>,
}

impl Fetchers {
    fn count(&self, f: impl FnOnce(&mut fdstore::FdStore)) {
        fdstore::update(&self.store, &self.tx, |st| (f(st), true));
    }
}

/// Serve `slot`'s fetch socket until the pair ends (the task is aborted).
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
                shared.count(fdstore::FdStore::fetch_refused);
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
        shared.count(fdstore::FdStore::fetch_refused);
        log::warn!("pair {}: fd store fetch refused: {why}", shared.id);
        refuse(conn, &why).await;
        return;
    }
    // The lock holder serves: new connections go to it at once.
    let who = shared.handoff.as_ref().and_then(|h| {
        h.fetch_answered(slot);
        h.recipient(slot)
    });
    // Everything sent to the notify sockets before this fetch is in the
    // store once each socket has been seen with nothing unread.
    let asked = Instant::now();
    let until = asked + DRAIN_WAIT;
    let mut read_up = vec![false; shared.notify.len()];
    loop {
        for (seen, sock) in read_up.iter_mut().zip(&shared.notify) {
            *seen = *seen || !sock.has_unread();
        }
        if read_up.iter().all(|s| *s) || Instant::now() >= until {
            break;
        }
        tokio::time::sleep(DRAIN_LOOK).await;
    }
    let drained = asked.elapsed();
    let copies = fdstore::lock(&shared.store).copies_for(who);
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
            shared.count(|st| st.fetched(total));
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
