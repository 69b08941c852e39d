//! Listening sockets the pair owns (`shadow.dev/listen`, config key
//! `pair.listen`), their names:
//!
//! - [`parse`]: the value, `tcp:<ipv4>:<port>`, `tcp:[<ipv6>]:<port>` or
//!   `unix:<absolute path in the container>`, comma-separated. The shim
//!   makes each socket once per pair and hands it to every engine it starts;
//! - [`env_entries`] and [`Listen::fd_name`]: how they are handed, by the
//!   systemd socket-activation convention (`LISTEN_FDS`, `LISTEN_PID`,
//!   `LISTEN_FDNAMES`, descriptors from [`FIRST_FD`]); an engine takes them
//!   with `shadow-engine-kit`'s `listen::inherited`.
//!
//! The socket outlives every engine, so a connection that arrives while no
//! engine is active waits in the kernel's backlog instead of being refused.

use std::net::SocketAddr;
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
}
