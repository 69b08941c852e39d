//! The engine's side of the pair's listening sockets (`shadow.dev/listen`;
//! the value's grammar and the variables' names are
//! [`shadow_contract::listen`]'s): [`inherited`] takes them, by the systemd
//! socket-activation convention (`LISTEN_FDS`, `LISTEN_PID`,
//! `LISTEN_FDNAMES`, descriptors from 3), as `sd_listen_fds(3)` reads it
//! (the `sd-notify` crate reads it here). After the sockets come the fd
//! store's descriptors ([`crate::fdstore::split_inherited`]) and, with
//! `shadow.dev/accept: runtime`, hand-off sockets under the sockets' names
//! ([`crate::handoff`]).

use std::os::fd::{FromRawFd, OwnedFd};

use shadow_contract::fdstore::MAX_MAX;
use shadow_contract::listen::MAX_SOCKETS;

/// One inherited socket.
#[derive(Debug)]
pub struct Inherited {
    /// Its `LISTEN_FDNAMES` entry (`unknown` when none was given).
    pub name: String,
    pub fd: OwnedFd,
}

/// Most descriptors [`inherited`] takes (the sockets and a full fd store,
/// `shadow_contract::fdstore::MAX_MAX`): a sanity bound on a count anyone
/// could set.
const MAX_INHERITED: usize = MAX_SOCKETS + MAX_MAX as usize;

/// The listening sockets this process inherited, as
/// `sd_listen_fds_with_names(3)` finds them (read by the `sd-notify`
/// crate): none unless `LISTEN_PID` is this process's pid and `LISTEN_FDS`
/// a count; then descriptors 3.. are taken (made close-on-exec) and owned
/// by the caller, each with its `LISTEN_FDNAMES` entry (`unknown` when
/// there is none or it is empty). What `sd_listen_fds_with_names` refuses
/// gives none too: a `LISTEN_PID` or `LISTEN_FDS` that is no number, a
/// descriptor of the range that is not open, a `LISTEN_FDNAMES` with
/// another count of names; so does a count above [`MAX_INHERITED`].
///
/// Call it once: a second call would own the same descriptors twice, so it
/// returns none. The variables stay, as `sd_listen_fds(0)` leaves them
/// (unsetting them would take `std::env::remove_var`, unsound once other
/// threads run).
pub fn inherited() -> Vec<Inherited> {
    use std::sync::atomic::{AtomicBool, Ordering};
    static TAKEN: AtomicBool = AtomicBool::new(false);
    // Checked first, so that a second call does not touch descriptors the
    // first one's owners may have closed (and the numbers been reused).
    if TAKEN.load(Ordering::Acquire) {
        return Vec::new();
    }
    let Ok(fds) = sd_notify::listen_fds_with_names() else {
        return Vec::new();
    };
    if fds.len() == 0 || fds.len() > MAX_INHERITED || TAKEN.swap(true, Ordering::AcqRel) {
        return Vec::new();
    }
    fds.map(|(fd, name)| {
        let name = if name.is_empty() {
            "unknown".to_string()
        } else {
            name
        };
        // SAFETY: sd-notify found `fd` open (it set FD_CLOEXEC on it) in
        // the range 3..3+LISTEN_FDS that socket activation gives this
        // process, whose pid LISTEN_PID names; TAKEN makes this call the
        // only one that takes it, so the caller is its only owner.
        let fd = unsafe { OwnedFd::from_raw_fd(fd) };
        Inherited { name, fd }
    })
    .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use shadow_contract::env;
    use shadow_contract::listen::FIRST_FD;

    /// Marks a run of [`child_side`] as the child of one of the tests
    /// below (without it, as in `cargo test -- --include-ignored`, it
    /// passes at once).
    const CHILD: &str = "SHADOW_ENGINE_KIT_INHERITED_CHILD";

    /// Runs [`child_side`] in a child process with `open` sockets at
    /// descriptors 3.. (the next one closed) and the `LISTEN_*` variables
    /// of `vars`, and returns the line it printed. The child is this test
    /// binary exec'd by `sh`, so that `LISTEN_PID` can name its own pid
    /// (`$$`, which `exec` keeps) unless `vars` gives one (`-`: unset).
    fn in_child(open: usize, vars: &[(&str, &str)]) -> String {
        use std::os::fd::AsRawFd;
        use std::os::unix::net::UnixStream;
        use std::os::unix::process::CommandExt;
        let pairs: Vec<(UnixStream, UnixStream)> =
            (0..open).map(|_| UnixStream::pair().unwrap()).collect();
        // Copies at 10 and up, made before the fork: placing them at 3..
        // in the child then cannot close one not yet placed.
        let high: Vec<OwnedFd> = pairs
            .iter()
            .map(|(a, _)| {
                // SAFETY: F_DUPFD_CLOEXEC of a descriptor we hold open; it
                // returns a new descriptor or -1.
                let fd = unsafe { libc::fcntl(a.as_raw_fd(), libc::F_DUPFD_CLOEXEC, 10) };
                assert!(fd >= 10, "{}", std::io::Error::last_os_error());
                // SAFETY: the kernel just returned this descriptor to us.
                unsafe { OwnedFd::from_raw_fd(fd) }
            })
            .collect();
        let raw: Vec<i32> = high.iter().map(|fd| fd.as_raw_fd()).collect();
        let mut cmd = std::process::Command::new("/bin/sh");
        cmd.arg("-c")
            .arg(
                r#"case "${FAKE_LISTEN_PID-}" in
                    "") LISTEN_PID=$$; export LISTEN_PID ;;
                    -) unset LISTEN_PID ;;
                    *) LISTEN_PID=$FAKE_LISTEN_PID; export LISTEN_PID ;;
                esac
                exec "$0" "$@""#,
            )
            .arg(std::env::current_exe().unwrap())
            .args(["--exact", "listen::tests::child_side", "--ignored"])
            .args(["--nocapture", "--test-threads=1", "-q"])
            .env(CHILD, "1");
        for k in env::LISTEN {
            cmd.env_remove(k);
        }
        for (k, v) in vars {
            cmd.env(
                if *k == env::LISTEN_PID {
                    "FAKE_LISTEN_PID"
                } else {
                    *k
                },
                v,
            );
        }
        // SAFETY: between fork and exec this makes dup2/close syscalls only
        // (async-signal-safe, no allocation), on descriptor numbers from
        // `raw`, which was filled before the fork and is only read here.
        unsafe {
            cmd.pre_exec(move || {
                for (i, fd) in raw.iter().enumerate() {
                    if libc::dup2(*fd, FIRST_FD + i as i32) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                }
                libc::close(FIRST_FD + raw.len() as i32);
                Ok(())
            });
        }
        let out = cmd.output().unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{:?}: {stdout}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        stdout
            .lines()
            .find_map(|l| l.strip_prefix("INHERITED "))
            .unwrap_or_else(|| panic!("no INHERITED line: {stdout}"))
            .to_string()
    }

    /// The child side: takes what it inherited, twice, and says what it
    /// got (`name@fd`, and whether each is close-on-exec), how many the
    /// second call got, how many `LISTEN_*` variables are still set, and
    /// the state of descriptor 3 afterwards.
    #[test]
    #[ignore = "the child of the inherited_* tests, which give it its descriptors"]
    fn child_side() {
        use std::os::fd::AsRawFd;
        if std::env::var_os(CHILD).is_none() {
            return;
        }
        let state = |fd: i32| {
            // SAFETY: F_GETFD reads the flags of a descriptor number; -1
            // (EBADF) when nothing is open there.
            match unsafe { libc::fcntl(fd, libc::F_GETFD) } {
                f if f < 0 => "closed",
                f if f & libc::FD_CLOEXEC != 0 => "cloexec",
                _ => "open",
            }
        };
        let first = inherited();
        let got: Vec<String> = first
            .iter()
            .map(|i| {
                format!(
                    "{}@{} {}",
                    i.name,
                    i.fd.as_raw_fd(),
                    state(i.fd.as_raw_fd())
                )
            })
            .collect();
        let again = inherited().len();
        let kept = env::LISTEN
            .iter()
            .filter(|k| std::env::var_os(k).is_some())
            .count();
        println!(
            "INHERITED [{}] again {again} vars {kept} fd3 {}",
            got.join(", "),
            state(FIRST_FD)
        );
    }

    #[test]
    fn the_named_pid_takes_its_descriptors_once_with_their_names() {
        let two = [
            (env::LISTEN_FDS, "2"),
            (env::LISTEN_FDNAMES, "tcp-8000:unix-e.sock"),
        ];
        assert_eq!(
            in_child(2, &two),
            "[tcp-8000@3 cloexec, unix-e.sock@4 cloexec] again 0 vars 3 fd3 cloexec",
            "both taken, close-on-exec, once; the variables stay"
        );
        assert_eq!(
            in_child(1, &[(env::LISTEN_FDS, "1")]),
            "[unknown@3 cloexec] again 0 vars 2 fd3 cloexec",
            "no LISTEN_FDNAMES"
        );
        assert_eq!(
            in_child(1, &[(env::LISTEN_FDS, "1"), (env::LISTEN_FDNAMES, "")]),
            "[unknown@3 cloexec] again 0 vars 3 fd3 cloexec",
            "an empty name"
        );
    }

    #[test]
    fn descriptors_meant_for_another_are_left_alone() {
        let parent = std::process::id().to_string();
        for pid in [parent.as_str(), "-", "x"] {
            assert_eq!(
                in_child(1, &[(env::LISTEN_PID, pid), (env::LISTEN_FDS, "1")]),
                format!(
                    "[] again 0 vars {} fd3 open",
                    if pid == "-" { 1 } else { 2 }
                ),
                "LISTEN_PID={pid}"
            );
        }
    }

    #[test]
    fn what_sd_listen_fds_refuses_gives_none() {
        for (open, vars, what) in [
            (1, &[(env::LISTEN_FDS, "0")][..], "a count of 0"),
            (1, &[(env::LISTEN_FDS, "x")], "no count"),
            (1, &[], "no LISTEN_FDS"),
            (1, &[(env::LISTEN_FDS, "2")], "a descriptor not open"),
            (1, &[(env::LISTEN_FDS, "100000")], "a count beyond any"),
            (
                2,
                &[(env::LISTEN_FDS, "2"), (env::LISTEN_FDNAMES, "tcp-8000")],
                "one name for two",
            ),
        ] {
            let seen = in_child(open, vars);
            assert!(seen.starts_with("[] again 0 "), "{what}: {seen}");
        }
    }
}
