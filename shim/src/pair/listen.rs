//! The pair's listening sockets (`shadow.dev/listen`, config
//! `pair.listen`): made once at Create, inside the pair's network namespace
//! (the sandbox's, the pinned one, or the host's for a host-network spec),
//! with a deep backlog, and handed to every engine the pair starts as
//! descriptors 3.. (`LISTEN_FDS`). They live as long as the pair: an
//! engine's death closes only its copies, so a client that connects while
//! no engine is active waits in the backlog instead of being refused.
//!
//! A Unix socket is bound in the pair's host directory (root-only, never a
//! path a container can write) and bind-mounted at its path in the
//! container.
//!
//! What a container could not do itself is refused here too: a port below
//! the namespace's `ip_unprivileged_port_start` needs `CAP_NET_BIND_SERVICE`
//! in the spec's effective capabilities.

use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd};
use std::path::{Path, PathBuf};

use nix::sys::socket::{
    bind, getsockopt, listen, setsockopt, socket, sockopt, AddressFamily, Backlog, SockFlag,
    SockType, SockaddrIn, SockaddrIn6, UnixAddr,
};
use shadow_contract::annotations::LISTEN;
use shadow_contract::listen::Listen;

use crate::error::{Error, Result};

/// Pending connections the kernel keeps per socket while no engine accepts
/// (capped by `net.core.somaxconn`, 4096 by default).
const BACKLOG: i32 = 4096;
/// The capability a privileged port needs.
const BIND_CAP: &str = "CAP_NET_BIND_SERVICE";

/// The sockets, in the order asked (descriptor 3 is the first).
#[derive(Debug)]
pub struct ListenSockets {
    fds: Vec<OwnedFd>,
    /// Which of `fds` are TCP (the ones [`ListenSockets::repair`] can mend).
    tcp: Vec<bool>,
    names: Vec<String>,
    /// Unix sockets: (host path, path in the container).
    mounts: Vec<(PathBuf, PathBuf)>,
}

/// Where and for whom the sockets are made.
pub struct Site<'a> {
    /// The network namespace file to make TCP sockets in; None: the shim's
    /// own (the host's: a host-network spec).
    pub netns: Option<&'a Path>,
    /// Root-only host directory for the Unix sockets.
    pub dir: &'a Path,
    /// Whether the container may bind a privileged port itself.
    pub may_bind_privileged: bool,
}

impl ListenSockets {
    /// Make every socket of `list`, or none: on an error the ones made are
    /// closed (and the Unix files go with the pair directory).
    pub fn open(list: &[Listen], site: &Site<'_>) -> Result<Self> {
        if list.iter().any(|l| matches!(l, Listen::Unix(_))) {
            std::fs::create_dir_all(site.dir)
                .map_err(|e| Error::io(format!("creating {}", site.dir.display()), e))?;
        }
        let names = list.iter().map(Listen::fd_name).collect();
        let is_tcp = list.iter().map(|l| matches!(l, Listen::Tcp(_))).collect();
        let mounts = list
            .iter()
            .enumerate()
            .filter_map(|(i, l)| match l {
                Listen::Unix(p) => Some((site.dir.join(format!("{i}.sock")), p.clone())),
                Listen::Tcp(_) => None,
            })
            .collect();
        let list = list.to_vec();
        let netns = site.netns.map(Path::to_path_buf);
        let dir = site.dir.to_path_buf();
        let privileged = site.may_bind_privileged;
        // Network namespaces are per thread: a short-lived one enters the
        // pair's, makes the sockets (which keep that namespace) and ends.
        let made = std::thread::spawn(move || -> Result<Vec<OwnedFd>> {
            if let Some(ns) = &netns {
                enter_netns(ns)?;
            }
            let first_free = unprivileged_port_start();
            let mut fds = Vec::with_capacity(list.len());
            for (i, l) in list.iter().enumerate() {
                fds.push(match l {
                    Listen::Tcp(addr) => {
                        if addr.port() < first_free && !privileged {
                            return Err(Error::InvalidArgument(format!(
                                "{LISTEN} {l}: port {} is privileged in the pair's network namespace (below {first_free}) and the container's process lacks {BIND_CAP}",
                                addr.port()
                            )));
                        }
                        tcp(l, addr, netns.as_deref())?
                    }
                    Listen::Unix(_) => unix(l, &dir.join(format!("{i}.sock")))?,
                });
            }
            Ok(fds)
        })
        .join()
        .map_err(|_| Error::FailedPrecondition("listening-socket thread panicked".into()))??;
        Ok(ListenSockets {
            fds: made,
            tcp: is_tcp,
            names,
            mounts,
        })
    }

    /// Listen again on every TCP socket that stopped listening: any engine
    /// holds the socket itself, and `shutdown(2)` on it stops it for the
    /// whole pair (the socket stays bound to its port, so `listen` mends
    /// it). Called before each engine start, so a broken socket lives no
    /// longer than the engine that broke it. Returns how many were mended.
    pub fn repair(&self) -> usize {
        let mut mended = 0;
        for (i, fd) in self.fds.iter().enumerate() {
            if !self.tcp[i] || getsockopt(fd, sockopt::AcceptConn).unwrap_or(true) {
                continue;
            }
            match listen(fd, Backlog::new(BACKLOG).unwrap_or(Backlog::MAXCONN)) {
                Ok(()) => {
                    log::warn!(
                        "{LISTEN}: socket {} had stopped listening (an engine shut it down): listening again",
                        self.names[i]
                    );
                    mended += 1;
                }
                Err(e) => log::warn!("{LISTEN}: socket {} stopped listening: {e}", self.names[i]),
            }
        }
        mended
    }

    /// The descriptors, in `LISTEN_FDS` order, for one engine's start.
    pub fn fds(&self) -> Vec<BorrowedFd<'_>> {
        self.fds.iter().map(AsFd::as_fd).collect()
    }

    /// A copy of each socket, in `LISTEN_FDS` order, for the runtime's
    /// acceptors.
    pub fn copies(&self) -> Result<Vec<OwnedFd>> {
        self.fds
            .iter()
            .map(|fd| {
                fd.try_clone()
                    .map_err(|e| Error::io("copying a listening socket", e))
            })
            .collect()
    }

    /// `LISTEN_FDNAMES`, one per socket.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// The Unix sockets: (host path, path in the container).
    pub fn mounts(&self) -> &[(PathBuf, PathBuf)] {
        &self.mounts
    }
}

fn enter_netns(ns: &Path) -> Result<()> {
    let f = std::fs::File::open(ns)
        .map_err(|e| Error::io(format!("opening network namespace {}", ns.display()), e))?;
    nix::sched::setns(f, nix::sched::CloneFlags::CLONE_NEWNET).map_err(|e| {
        Error::sys(
            format!("entering network namespace {} for {LISTEN}", ns.display()),
            e,
        )
    })
}

/// `net.ipv4.ip_unprivileged_port_start` of the calling thread's network
/// namespace (`/proc/sys/net` shows the reading thread's); 1024 if
/// unreadable.
fn unprivileged_port_start() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_unprivileged_port_start")
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(1024)
}

fn listening(l: &Listen, fd: &OwnedFd) -> Result<()> {
    listen(fd, Backlog::new(BACKLOG).unwrap_or(Backlog::MAXCONN))
        .map_err(|e| Error::sys(format!("{LISTEN} {l}: listen"), e))
}

fn tcp(l: &Listen, addr: &std::net::SocketAddr, netns: Option<&Path>) -> Result<OwnedFd> {
    let family = if addr.is_ipv4() {
        AddressFamily::Inet
    } else {
        AddressFamily::Inet6
    };
    let fd = socket(family, SockType::Stream, SockFlag::SOCK_CLOEXEC, None)
        .map_err(|e| Error::sys(format!("{LISTEN} {l}: socket"), e))?;
    setsockopt(&fd, sockopt::ReuseAddr, &true)
        .map_err(|e| Error::sys(format!("{LISTEN} {l}: SO_REUSEADDR"), e))?;
    let bound = match addr {
        std::net::SocketAddr::V4(a) => bind(fd.as_raw_fd(), &SockaddrIn::from(*a)),
        std::net::SocketAddr::V6(a) => bind(fd.as_raw_fd(), &SockaddrIn6::from(*a)),
    };
    bound.map_err(|e| {
        let place = netns.map_or(
            "the host's network (the spec has no network namespace)".into(),
            |p| format!("the pair's network namespace {}", p.display()),
        );
        match e {
            nix::errno::Errno::EADDRINUSE => Error::FailedPrecondition(format!(
                "{LISTEN} {l}: port {} is already in use in {place}",
                addr.port()
            )),
            nix::errno::Errno::EADDRNOTAVAIL => Error::InvalidArgument(format!(
                "{LISTEN} {l}: address {} does not exist in {place}",
                addr.ip()
            )),
            e => Error::sys(format!("{LISTEN} {l}: bind in {place}"), e),
        }
    })?;
    listening(l, &fd)?;
    Ok(fd)
}

fn unix(l: &Listen, host: &Path) -> Result<OwnedFd> {
    use std::os::unix::fs::PermissionsExt;
    let fd = socket(
        AddressFamily::Unix,
        SockType::Stream,
        SockFlag::SOCK_CLOEXEC,
        None,
    )
    .map_err(|e| Error::sys(format!("{LISTEN} {l}: socket"), e))?;
    let addr = UnixAddr::new(host)
        .map_err(|e| Error::sys(format!("{LISTEN} {l}: host path {}", host.display()), e))?;
    bind(fd.as_raw_fd(), &addr)
        .map_err(|e| Error::sys(format!("{LISTEN} {l}: bind {}", host.display()), e))?;
    // Who may connect is decided by who can reach the path in the
    // container, as for a socket the engine would bind itself.
    std::fs::set_permissions(host, std::fs::Permissions::from_mode(0o666))
        .map_err(|e| Error::io(format!("{LISTEN} {l}: chmod {}", host.display()), e))?;
    listening(l, &fd)?;
    Ok(fd)
}

/// Whether the spec's process may bind a privileged port itself.
pub fn may_bind_privileged(spec: &serde_json::Value) -> bool {
    spec.pointer("/process/capabilities/effective")
        .and_then(serde_json::Value::as_array)
        .is_some_and(|caps| caps.iter().any(|c| c.as_str() == Some(BIND_CAP)))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn site(dir: &Path, privileged: bool) -> Site<'_> {
        Site {
            netns: None,
            dir,
            may_bind_privileged: privileged,
        }
    }

    #[test]
    fn tcp_and_unix_sockets_listen_and_queue_without_an_acceptor() {
        let dir = tempfile::tempdir().unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .unwrap()
            .port();
        let list =
            shadow_contract::listen::parse(&format!("tcp:127.0.0.1:{port},unix:/run/e.sock"))
                .unwrap();
        let s = ListenSockets::open(&list, &site(dir.path(), false)).unwrap();
        assert_eq!(s.fds().len(), 2);
        assert_eq!(s.names(), [format!("tcp-{port}"), "unix-e.sock".into()]);
        assert_eq!(
            s.mounts(),
            [(dir.path().join("1.sock"), PathBuf::from("/run/e.sock"))]
        );
        // Nobody accepts, yet connecting succeeds: the backlog holds it.
        std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
        std::os::unix::net::UnixStream::connect(dir.path().join("1.sock")).unwrap();
        // The port is taken while the pair lives.
        let again = ListenSockets::open(&list[..1], &site(dir.path(), false)).unwrap_err();
        assert!(
            matches!(again, Error::FailedPrecondition(_))
                && again.to_string().contains("already in use"),
            "{again}"
        );
    }

    #[test]
    fn a_socket_an_engine_shut_down_is_mended_before_the_next_start() {
        let dir = tempfile::tempdir().unwrap();
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .unwrap()
            .port();
        let list = shadow_contract::listen::parse(&format!("tcp:127.0.0.1:{port}")).unwrap();
        let s = ListenSockets::open(&list, &site(dir.path(), false)).unwrap();
        assert_eq!(s.repair(), 0, "a listening socket is left alone");
        // What a hostile engine can do with its copy.
        let copy = s.fds()[0].try_clone_to_owned().unwrap();
        nix::sys::socket::shutdown(copy.as_raw_fd(), nix::sys::socket::Shutdown::Both).unwrap();
        let refused = std::net::TcpStream::connect(("127.0.0.1", port)).unwrap_err();
        assert_eq!(refused.kind(), std::io::ErrorKind::ConnectionRefused);
        assert_eq!(s.repair(), 1);
        std::net::TcpStream::connect(("127.0.0.1", port)).unwrap();
    }

    #[test]
    fn a_privileged_port_needs_the_capability() {
        let dir = tempfile::tempdir().unwrap();
        let list = shadow_contract::listen::parse("tcp:127.0.0.1:81").unwrap();
        let e = ListenSockets::open(&list, &site(dir.path(), false)).unwrap_err();
        assert!(e.to_string().contains(BIND_CAP), "{e}");
        assert!(may_bind_privileged(
            &json!({"process": {"capabilities": {"effective": ["CAP_CHOWN", BIND_CAP]}}})
        ));
        assert!(!may_bind_privileged(
            &json!({"process": {"capabilities": {"bounding": [BIND_CAP]}}})
        ));
        assert!(!may_bind_privileged(&json!({"process": {}})));
    }
}
