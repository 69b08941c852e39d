//! The daemon's main thread: [`serve`] sets up (stop signals, the socket,
//! the shared state), accepts connections until SIGTERM or SIGINT, then
//! shuts down. It exists apart from the connection code because it is the
//! only place that owns the listener and the connection threads' handles,
//! and the only one that decides when the daemon stops.
//!
//! After a failed `accept` (EMFILE, ENFILE, ENOMEM, ENOBUFS) the connection
//! stays queued and the listener stays readable: polling it again at once
//! would spin, so accepts pause (signals are still watched), from
//! `ACCEPT_BACKOFF_MIN` doubling up to `ACCEPT_BACKOFF_MAX`.

use std::os::fd::AsFd;
use std::os::unix::net::UnixListener;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};
use nix::sys::signal::{SigSet, Signal};
use nix::sys::signalfd::{SfdFlags, SignalFd};

use gms::{wire, Error, Result};

use super::socket::{self, SocketFile};
use super::{Config, Daemon, State};
use crate::backend::Backend;

const ACCEPT_BACKOFF_MIN: Duration = Duration::from_millis(10);
const ACCEPT_BACKOFF_MAX: Duration = Duration::from_secs(1);

/// Runs the daemon until SIGTERM or SIGINT. `ready` is called once the
/// socket accepts connections. Everything is freed before this returns.
pub fn serve(config: Config, backend: Box<dyn Backend>, ready: impl FnOnce(&Path)) -> Result<()> {
    let signals = stop_signals()?;

    config.limits.check()?;
    socket::prepare_dir(&config.socket_dir)?;
    let socket = config.socket_dir.join(backend.socket_name());
    let listener = socket::bind(&socket, config.socket_group)?;
    let _socket_file = SocketFile(socket.clone());
    listener
        .set_nonblocking(true)
        .map_err(|e| Error::io(format!("O_NONBLOCK on {}", socket.display()), e))?;

    let daemon = Arc::new(Daemon {
        backend,
        config,
        socket: socket.clone(),
        state: Mutex::new(State::default()),
    });
    tracing::info!(
        socket = %socket.display(),
        backend = daemon.backend.name(),
        device = %daemon.backend.device(),
        "gmsd serving"
    );
    ready(&socket);

    let threads = accept_until_stopped(&daemon, &listener, &signals)?;
    shut_down(&daemon, threads);
    Ok(())
}

/// Blocks the stop signals and returns a descriptor that reads them. Called
/// before any thread exists, so every thread inherits the mask and only the
/// signalfd sees them.
fn stop_signals() -> Result<SignalFd> {
    let mut stop = SigSet::empty();
    stop.add(Signal::SIGTERM);
    stop.add(Signal::SIGINT);
    stop.thread_block()
        .map_err(|e| Error::sys("blocking SIGTERM/SIGINT", e))?;
    SignalFd::with_flags(&stop, SfdFlags::SFD_CLOEXEC)
        .map_err(|e| Error::sys("signalfd for SIGTERM/SIGINT", e))
}

/// Accepts connections until a stop signal arrives; returns the threads of
/// the connections that may still be open.
fn accept_until_stopped(
    daemon: &Arc<Daemon>,
    listener: &UnixListener,
    signals: &SignalFd,
) -> Result<Vec<JoinHandle<()>>> {
    let mut threads: Vec<JoinHandle<()>> = Vec::new();
    // Zero while listening; else how long accepts pause (signals only).
    let mut backoff = Duration::ZERO;
    loop {
        let listening = backoff.is_zero();
        let mut fds = [
            PollFd::new(signals.as_fd(), PollFlags::POLLIN),
            PollFd::new(listener.as_fd(), PollFlags::POLLIN),
        ];
        let (watched, timeout) = if listening {
            (&mut fds[..], PollTimeout::NONE)
        } else {
            let ms = u16::try_from(backoff.as_millis()).unwrap_or(u16::MAX);
            (&mut fds[..1], PollTimeout::from(ms))
        };
        match poll(watched, timeout) {
            Ok(_) | Err(nix::errno::Errno::EINTR) => {}
            Err(e) => return Err(Error::sys("poll on listener and signalfd", e)),
        }
        let signalled = fds[0].revents().is_some_and(|r| !r.is_empty());
        let incoming = !listening || fds[1].revents().is_some_and(|r| !r.is_empty());
        if signalled {
            if let Ok(Some(info)) = signals.read_signal() {
                tracing::info!(signal = info.ssi_signo, "stopping");
            }
            return Ok(threads);
        }
        if incoming {
            backoff = accept_one(daemon, listener, backoff, &mut threads);
            threads.retain(|t| !t.is_finished());
        }
    }
}

/// One `accept`: admits the peer (its thread joins `threads`) and returns
/// the back-off that follows: none after a success or an empty queue, the
/// previous one doubled after a failure.
fn accept_one(
    daemon: &Arc<Daemon>,
    listener: &UnixListener,
    backoff: Duration,
    threads: &mut Vec<JoinHandle<()>>,
) -> Duration {
    match listener.accept() {
        Ok((stream, _)) => {
            // Only `kv_pool` carries a descriptor (its proof), and only a
            // daemon that knows the pair's lock grants it: any other
            // refuses descriptors at the kernel. (What a peer sends
            // anyway is owned by `wire::recv`, counted by the decoder
            // against what the request may carry, and closed.)
            if daemon.config.lock.is_none() {
                wire::refuse_rights(stream.as_fd());
            }
            if let Some(t) = daemon.admit(stream) {
                threads.push(t);
            }
            Duration::ZERO
        }
        Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => Duration::ZERO,
        Err(e) if e.kind() == std::io::ErrorKind::Interrupted => backoff,
        Err(e) => {
            let backoff = (backoff * 2).clamp(ACCEPT_BACKOFF_MIN, ACCEPT_BACKOFF_MAX);
            tracing::warn!(
                "accept on {}: {e}; pausing accepts for {backoff:?}",
                daemon.socket.display()
            );
            backoff
        }
    }
}

/// Wakes every connection thread (its recv returns end-of-stream), lets
/// each release its lease, then drops all memory.
fn shut_down(daemon: &Daemon, threads: Vec<JoinHandle<()>>) {
    for conn in daemon.lock().connections.values() {
        let _ = conn.stream.shutdown(std::net::Shutdown::Both);
    }
    for t in threads {
        let _ = t.join();
    }
    let mut st = daemon.lock();
    st.working = None;
    st.committed = None;
    tracing::info!("gmsd stopped; all allocations freed");
}
