//! Listening sockets the pair owns (`shadow.dev/listen`, config key
//! `pair.listen`), both sides of them:
//!
//! - [`parse`]: the value, `tcp:<ipv4>:<port>`, `tcp:[<ipv6>]:<port>` or
//!   `unix:<absolute path in the container>`, comma-separated. The shim
//!   makes each socket once per pair and hands it to every engine it starts;
//! - [`inherited`]: what an engine calls to take them, the systemd
//!   socket-activation convention (`LISTEN_FDS`, `LISTEN_PID`,
//!   `LISTEN_FDNAMES`, descriptors from 3), as `sd_listen_fds(3)` reads it.
//!
//! The socket outlives every engine, so a connection that arrives while no
//! engine is active waits in the kernel's backlog instead of being refused.

use std::net::SocketAddr;
use std::os::fd::{FromRawFd, OwnedFd};
use std::path::PathBuf;

use crate::env;
use crate::error::AnnotationError;

/// The annotation (`shadow.dev/listen`, also
/// [`crate::annotations::LISTEN`]). Spelt here, not taken from
/// `annotations`, because that module parses its value with [`parse`]:
/// `annotations` uses `listen`, never the other way round.
pub(crate) const KEY: &str = "shadow.dev/listen";

/// What `shadow.dev/listen` allows.
pub const ALLOWED: &str =
    "tcp:<ipv4>:<port>|tcp:[<ipv6>]:<port>|unix:<absolute path>[,...] (at most 16, port 1-65535)";
/// Most sockets one pair may own.
pub const MAX_SOCKETS: usize = 16;
/// The first inherited descriptor (`SD_LISTEN_FDS_START`).
pub const FIRST_FD: i32 = 3;
/// Longest Unix socket path a client can connect to (`sun_path` less its NUL).
const SUN_PATH_MAX: usize = 107;

/// One listening socket of a pair.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Listen {
    Tcp(SocketAddr),
    /// The path inside the container (absolute, no `.` or `..`).
    Unix(PathBuf),
}

impl Listen {
    /// Its name in `LISTEN_FDNAMES`: `tcp-<port>` or `unix-<file name>`
    /// (systemd names have no `:`).
    pub fn fd_name(&self) -> String {
        match self {
            Listen::Tcp(a) => format!("tcp-{}", a.port()),
            Listen::Unix(p) => format!(
                "unix-{}",
                p.file_name()
                    .map(|n| n.to_string_lossy().replace(':', "_"))
                    .unwrap_or_default()
            ),
        }
    }
}

impl std::fmt::Display for Listen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Listen::Tcp(a) => write!(f, "tcp:{a}"),
            Listen::Unix(p) => write!(f, "unix:{}", p.display()),
        }
    }
}

fn bad(value: &str, why: &str) -> AnnotationError {
    AnnotationError {
        key: KEY.to_string(),
        value: value.to_string(),
        allowed: format!("{ALLOWED}; {why}"),
    }
}

fn one(item: &str, whole: &str) -> Result<Listen, AnnotationError> {
    let (scheme, rest) = item
        .split_once(':')
        .ok_or_else(|| bad(whole, &format!("{item:?} has no scheme")))?;
    match scheme {
        "tcp" => {
            let addr: SocketAddr = rest.parse().map_err(|_| {
                bad(
                    whole,
                    &format!("{rest:?} is not <address>:<port> (an IPv6 address goes in brackets)"),
                )
            })?;
            if addr.port() == 0 {
                return Err(bad(
                    whole,
                    "port 0 would be a different port for every pair",
                ));
            }
            Ok(Listen::Tcp(addr))
        }
        "unix" => {
            // Checked as text: `Path::components` would hide a `.`.
            let clean = rest
                .strip_prefix('/')
                .is_some_and(|r| r.split('/').all(|c| !c.is_empty() && c != "." && c != ".."));
            if !clean {
                return Err(bad(
                    whole,
                    &format!("{rest:?} is not a path inside the container (absolute, no . or ..)"),
                ));
            }
            if rest.len() > SUN_PATH_MAX {
                return Err(bad(
                    whole,
                    &format!("{rest:?} is longer than a Unix socket path may be ({SUN_PATH_MAX})"),
                ));
            }
            Ok(Listen::Unix(PathBuf::from(rest)))
        }
        other => Err(bad(whole, &format!("unknown scheme {other:?}"))),
    }
}

/// The sockets a value asks for, in order, each once.
pub fn parse(value: &str) -> Result<Vec<Listen>, AnnotationError> {
    let mut out: Vec<Listen> = Vec::new();
    for item in value.split(',').map(str::trim) {
        if item.is_empty() {
            return Err(bad(value, "an empty item"));
        }
        let l = one(item, value)?;
        if out.contains(&l) {
            return Err(bad(value, &format!("{item} twice")));
        }
        out.push(l);
    }
    if out.len() > MAX_SOCKETS {
        return Err(bad(value, &format!("{} sockets", out.len())));
    }
    Ok(out)
}

/// The environment an engine gets with `n` sockets named `names`:
/// `LISTEN_FDS`, `LISTEN_PID` (1: the engine is its container's init, in
/// its own pid namespace), `LISTEN_FDNAMES`.
pub fn env_entries(names: &[String]) -> [String; 3] {
    [
        env::entry(env::LISTEN_FDS, names.len()),
        env::entry(env::LISTEN_PID, 1),
        env::entry(env::LISTEN_FDNAMES, names.join(":")),
    ]
}

/// One inherited socket.
#[derive(Debug)]
pub struct Inherited {
    /// Its `LISTEN_FDNAMES` entry (`unknown` when none was given).
    pub name: String,
    pub fd: OwnedFd,
}

/// The listening sockets this process inherited, as `sd_listen_fds(3)`
/// finds them: none unless `LISTEN_PID` is this process's pid and
/// `LISTEN_FDS` a count; then descriptors 3.. are taken (made close-on-exec)
/// and owned by the caller. Call it once: a second call would own the same
/// descriptors twice, so it returns none (the variables stay, as
/// `sd_listen_fds(0)` leaves them).
pub fn inherited() -> Vec<Inherited> {
    use std::sync::atomic::{AtomicBool, Ordering};
    static TAKEN: AtomicBool = AtomicBool::new(false);
    let var = |k| std::env::var(k).ok();
    let Some(n) = from_env(
        var(env::LISTEN_PID).as_deref(),
        var(env::LISTEN_FDS).as_deref(),
        std::process::id(),
    ) else {
        return Vec::new();
    };
    if TAKEN.swap(true, Ordering::AcqRel) {
        return Vec::new();
    }
    let names = var(env::LISTEN_FDNAMES).unwrap_or_default();
    let mut names = names.split(':');
    (0..n)
        .filter_map(|i| {
            let fd = FIRST_FD + i as i32;
            // SAFETY: F_SETFD on a descriptor number; fails harmlessly
            // (EBADF) when nothing is open there.
            if unsafe { libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC) } < 0 {
                return None;
            }
            let name = names
                .next()
                .filter(|s| !s.is_empty())
                .unwrap_or("unknown")
                .to_string();
            // SAFETY: the socket-activation convention gives this process
            // descriptors 3..3+n; TAKEN makes this the only owner.
            let fd = unsafe { OwnedFd::from_raw_fd(fd) };
            Some(Inherited { name, fd })
        })
        .collect()
}

/// `LISTEN_FDS` when `LISTEN_PID` names `pid` (at most [`MAX_SOCKETS`] × 64,
/// a sanity bound on a value anyone could set).
fn from_env(listen_pid: Option<&str>, listen_fds: Option<&str>, pid: u32) -> Option<usize> {
    let for_pid: u32 = listen_pid?.trim().parse().ok()?;
    if for_pid != pid {
        return None;
    }
    let n: usize = listen_fds?.trim().parse().ok()?;
    (n > 0 && n <= MAX_SOCKETS * 64).then_some(n)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tcp_and_unix_items_parse_in_order() {
        let l = parse("tcp:0.0.0.0:8000, unix:/run/engine.sock,tcp:[::1]:9000").unwrap();
        assert_eq!(
            l,
            [
                Listen::Tcp("0.0.0.0:8000".parse().unwrap()),
                Listen::Unix("/run/engine.sock".into()),
                Listen::Tcp("[::1]:9000".parse().unwrap()),
            ]
        );
        let names: Vec<String> = l.iter().map(Listen::fd_name).collect();
        assert_eq!(names, ["tcp-8000", "unix-engine.sock", "tcp-9000"]);
        assert_eq!(l[0].to_string(), "tcp:0.0.0.0:8000");
        assert_eq!(
            env_entries(&names),
            [
                "LISTEN_FDS=3",
                "LISTEN_PID=1",
                "LISTEN_FDNAMES=tcp-8000:unix-engine.sock:tcp-9000"
            ]
        );
    }

    #[test]
    fn bad_values_say_why() {
        for (v, why) in [
            ("udp:0.0.0.0:53", "unknown scheme \"udp\""),
            ("8000", "no scheme"),
            ("tcp:localhost:80", "not <address>:<port>"),
            ("tcp:::1:80", "not <address>:<port>"),
            ("tcp:0.0.0.0:0", "port 0"),
            ("tcp:0.0.0.0:70000", "not <address>:<port>"),
            ("unix:run/x.sock", "not a path inside the container"),
            (
                "unix:/run/../../etc/x.sock",
                "not a path inside the container",
            ),
            ("unix:/run/./x.sock", "not a path inside the container"),
            ("unix:/", "not a path inside the container"),
            ("unix:/run/", "not a path inside the container"),
            ("tcp:0.0.0.0:1,,tcp:0.0.0.0:2", "empty item"),
            ("tcp:0.0.0.0:1,tcp:0.0.0.0:1", "twice"),
        ] {
            let e = parse(v).unwrap_err();
            assert_eq!(e.key, KEY);
            let msg = e.to_string();
            assert!(
                msg.contains(why) && msg.contains("tcp:<ipv4>"),
                "{v}: {msg}"
            );
        }
        let long = format!("unix:/{}", "x".repeat(110));
        assert!(parse(&long).unwrap_err().to_string().contains("longer"));
        let many: Vec<String> = (1..=17).map(|p| format!("tcp:127.0.0.1:{p}")).collect();
        assert!(parse(&many.join(",")).is_err());
    }

    #[test]
    fn only_the_named_pid_takes_the_descriptors() {
        assert_eq!(from_env(Some("1"), Some("2"), 1), Some(2));
        assert_eq!(from_env(Some("7"), Some("2"), 1), None, "meant for another");
        assert_eq!(from_env(None, Some("2"), 1), None);
        assert_eq!(from_env(Some("1"), None, 1), None);
        assert_eq!(from_env(Some("1"), Some("0"), 1), None);
        assert_eq!(from_env(Some("1"), Some("x"), 1), None);
        assert_eq!(from_env(Some("1"), Some("100000"), 1), None);
    }
}
