//! What runs in gmsd's process between fork and exec: joining its cgroup,
//! setting its OOM score, dropping every capability, and a session of its
//! own.
//!
//! It exists apart because this is the one place where the usual rules of
//! Rust code do not hold: after fork, in a process that may have had other
//! threads, only async-signal-safe calls are sound. Everything here is raw
//! syscalls on paths and bytes prepared before the fork; no allocation, no
//! locks. Keep it so when touching it. Relied on elsewhere (see README.md):
//! the failed join is `_exit(JOIN_FAILED)`, never an `Err` (std would then
//! `waitpid` the child, which a subreaper's reaper may already have
//! reaped); every capability is dropped (bounding, ambient, then the three
//! sets); and the session of its own, by which the shim's leftover cleanup
//! recognises a pair's gmsd.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::Command;

/// gmsd's exit status when it could not join its cgroup (or set its OOM
/// score) before exec.
pub const JOIN_FAILED: i32 = 126;

/// Makes `cmd`'s child write itself into each `cgroup.procs` file of
/// `cgroup_procs` and set its `oom_score_adj` (clamped to -1000..=1000),
/// exiting with [`JOIN_FAILED`] if any write fails, and then drop every
/// capability, all before exec and in that order.
pub(crate) fn join_and_drop_capabilities(
    cmd: &mut Command,
    cgroup_procs: &[PathBuf],
    oom_score_adj: Option<i32>,
) {
    // Paths and bytes prepared here, before the fork.
    let joins: Vec<(CString, Vec<u8>)> = cgroup_procs
        .iter()
        .filter_map(|p| CString::new(p.as_os_str().as_bytes()).ok())
        .map(|p| (p, b"0".to_vec()))
        .chain(oom_score_adj.map(|adj| {
            let text = adj.clamp(-1000, 1000).to_string().into_bytes();
            (c"/proc/self/oom_score_adj".to_owned(), text)
        }))
        .collect();
    if !joins.is_empty() {
        // SAFETY: the closure runs between fork and exec and makes raw
        // open/write/close/_exit syscalls on paths and bytes prepared
        // before the fork: no allocation, no locks.
        unsafe {
            cmd.pre_exec(move || {
                for (path, text) in &joins {
                    if !write_file(path, text) {
                        // Not an Err: std would then wait for this
                        // child itself, which a subreaper's reaper may
                        // have taken. An early exit is what the
                        // launcher reports, with this on gmsd's log.
                        say(b"gmsd launcher: cannot write ");
                        say(path.as_bytes());
                        say(b" (joining gmsd's cgroup, or its OOM score)\n");
                        libc::_exit(JOIN_FAILED);
                    }
                }
                Ok(())
            });
        }
    }
    // SAFETY: the closure runs between fork and exec (or just before
    // exec) and makes raw prctl/capset syscalls only: no allocation,
    // no locks.
    unsafe {
        cmd.pre_exec(drop_all_capabilities);
    }
}

/// Makes `cmd`'s child lead a session of its own (`setsid`) before exec.
pub(crate) fn new_session(cmd: &mut Command) {
    // SAFETY: setsid is async-signal-safe and allocates nothing.
    unsafe {
        cmd.pre_exec(|| {
            if libc::setsid() < 0 {
                return Err(std::io::Error::last_os_error());
            }
            Ok(())
        });
    }
}

/// Writes `text` into the existing file `path` with raw syscalls (safe
/// between fork and exec). False if it could not.
fn write_file(path: &CString, text: &[u8]) -> bool {
    // SAFETY: open with a NUL-terminated path we own; the fd is closed below.
    let fd = unsafe { libc::open(path.as_ptr(), libc::O_WRONLY | libc::O_CLOEXEC) };
    if fd < 0 {
        return false;
    }
    // SAFETY: write from a live byte slice into the fd just opened.
    let n = unsafe { libc::write(fd, text.as_ptr().cast(), text.len()) };
    // SAFETY: closing the fd this function opened, once.
    unsafe { libc::close(fd) };
    n == text.len() as isize
}

/// Best effort, on stderr, between fork and exec.
fn say(bytes: &[u8]) {
    // SAFETY: write from a live byte slice to fd 2.
    unsafe { libc::write(2, bytes.as_ptr().cast(), bytes.len()) };
}

/// Drops every capability, between fork and exec. Raw syscalls only (no
/// allocation after fork): the bounding set first (needs CAP_SETPCAP, which
/// we still have), then ambient, then the three sets.
fn drop_all_capabilities() -> std::io::Result<()> {
    for cap in 0..64 {
        // SAFETY: prctl with integer arguments only; EINVAL past the last
        // capability the kernel knows is expected and ignored.
        unsafe { libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0) };
    }
    // SAFETY: integer arguments only.
    unsafe {
        libc::prctl(
            libc::PR_CAP_AMBIENT,
            libc::PR_CAP_AMBIENT_CLEAR_ALL,
            0,
            0,
            0,
        )
    };
    #[repr(C)]
    struct Header {
        version: u32,
        pid: i32,
    }
    #[repr(C)]
    #[derive(Clone, Copy)]
    struct Data {
        effective: u32,
        permitted: u32,
        inheritable: u32,
    }
    let header = Header {
        version: 0x2008_0522, // _LINUX_CAPABILITY_VERSION_3
        pid: 0,
    };
    let data = [Data {
        effective: 0,
        permitted: 0,
        inheritable: 0,
    }; 2];
    // SAFETY: capset reads one header and two data structs (version 3),
    // both valid for the duration of the call.
    let rc = unsafe { libc::syscall(libc::SYS_capset, &header as *const Header, data.as_ptr()) };
    if rc != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The raw write the join uses: all of it into a file that exists,
    /// nothing (and false) where there is none.
    #[test]
    fn a_file_is_written_whole_or_the_write_fails() {
        let dir = tempfile::tempdir().unwrap();
        let there = dir.path().join("cgroup.procs");
        std::fs::write(&there, "").unwrap();
        let path = CString::new(there.as_os_str().as_bytes()).unwrap();
        assert!(write_file(&path, b"0"));
        assert_eq!(std::fs::read(&there).unwrap(), b"0");
        let absent = dir.path().join("absent/cgroup.procs");
        let absent = CString::new(absent.as_os_str().as_bytes()).unwrap();
        assert!(!write_file(&absent, b"0"));
    }
}
