//! Who holds an exclusive `flock`, proven from `/proc/<pid>/fdinfo`, not
//! from `/proc/locks`.
//!
//! Why it is here: two programs read the pair's election lock off
//! `fdinfo`. The shim asks whether an engine that says `READY=1` (or asks
//! for its connections) holds it, from the engine's `/proc`; gmsd asks
//! whether the descriptor an engine shows for the KV pool's write lease
//! holds it, from its own ([`fdinfo_holds`]). Neither may wait on
//! `/proc/locks`: every read of it takes the kernel's `file_rwsem` for
//! writing, which waits out an RCU grace period (about 8 ms here, 12 on a
//! busy host), and both questions are asked on a failover's path.
//! `/proc/<pid>/fdinfo/<fd>` lists the locks held through that open file
//! under the file's own spinlock: the descriptor of the lock file that
//! says `FLOCK ... WRITE` is the holder.

use std::os::unix::fs::MetadataExt;

/// The lock file's identity (one definition, with the shim's: the
/// contract's).
pub use shadow_contract::lockfile::FileId;

/// The most descriptors (or children) looked at in one process: a process
/// with more is not proven this way (`None`).
pub const FDS_LOOKED_AT: usize = 4096;

/// Whether `pid`, or a child of it, holds `file`'s exclusive `flock`
/// through a descriptor it has open. Children first (an engine may hold
/// the lock from a small child, as the engine kit's lock holder does), then
/// `pid` itself. `Some(false)`: every descriptor of them was looked at and
/// none holds it; `None`: not every one could be (too many, or `/proc`
/// unreadable).
///
/// The children of `pid`'s main thread are looked at first, alone: a
/// holder forked first thing in `main` is one of them, and is found
/// without reading the children of every thread of a busy engine (those
/// reads were most of a proof's 0.2 to 0.4 ms).
pub fn held_by(pid: u32, file: FileId) -> Option<bool> {
    if let Some(first) = thread_children(pid, pid) {
        if first
            .into_iter()
            .any(|c| holds_through_fd(c, file) == Some(true))
        {
            return Some(true);
        }
    }
    let mut procs = children(pid)?;
    procs.push(pid);
    let mut complete = true;
    for p in procs {
        match holds_through_fd(p, file) {
            Some(true) => return Some(true),
            Some(false) => {}
            None => complete = false,
        }
    }
    complete.then_some(false)
}

/// The children of `pid`'s thread `tid`, if they can be read.
pub fn thread_children(pid: u32, tid: u32) -> Option<Vec<u32>> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/task/{tid}/children")).ok()?;
    Some(
        text.split_whitespace()
            .filter_map(|c| c.parse::<u32>().ok())
            .take(FDS_LOOKED_AT)
            .collect(),
    )
}

/// The children of every thread of `pid` (none of a process that is
/// gone); None when they cannot all be read.
fn children(pid: u32) -> Option<Vec<u32>> {
    let tasks = match std::fs::read_dir(format!("/proc/{pid}/task")) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Some(Vec::new()),
        Err(_) => return None,
    };
    let mut out = Vec::new();
    for task in tasks.flatten() {
        let mut path = task.path();
        path.push("children");
        match std::fs::read_to_string(&path) {
            Ok(text) => out.extend(
                text.split_whitespace()
                    .filter_map(|c| c.parse::<u32>().ok()),
            ),
            // A thread that just ended has no children file.
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(_) => return None,
        }
        if out.len() > FDS_LOOKED_AT {
            return None;
        }
    }
    Some(out)
}

/// Whether `pid` holds `file`'s exclusive flock through a descriptor of
/// its own (a process that is gone holds nothing); None when its
/// descriptors cannot all be looked at.
fn holds_through_fd(pid: u32, file: FileId) -> Option<bool> {
    let fds = match std::fs::read_dir(format!("/proc/{pid}/fd")) {
        Ok(f) => f,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Some(false),
        Err(_) => return None,
    };
    for (n, fd) in fds.flatten().enumerate() {
        if n >= FDS_LOOKED_AT {
            return None;
        }
        // stat follows the link to the open file itself.
        let Ok(md) = std::fs::metadata(fd.path()) else {
            continue;
        };
        if FileId::from_stat(md.dev(), md.ino()) != file {
            continue;
        }
        let info = format!("/proc/{pid}/fdinfo/{}", fd.file_name().to_string_lossy());
        if let Ok(text) = std::fs::read_to_string(info) {
            if fdinfo_holds(&text, file) {
                return Some(true);
            }
        }
    }
    Some(false)
}

/// Whether an fdinfo text lists an exclusive `flock` of `file`: its
/// `lock:` lines are `/proc/locks` records, `1: FLOCK  ADVISORY  WRITE
/// 1234 00:1a:5678 0 EOF`.
pub fn fdinfo_holds(text: &str, file: FileId) -> bool {
    text.lines()
        .filter_map(|l| l.strip_prefix("lock:"))
        .any(|record| {
            let f: Vec<&str> = record.split_whitespace().collect();
            f.len() >= 6 && f[1] == "FLOCK" && f[3] == "WRITE" && record_file(f[5]) == Some(file)
        })
}

/// `maj:min:inode`, majors and minors in hex as the kernel prints them.
fn record_file(field: &str) -> Option<FileId> {
    let mut parts = field.splitn(3, ':');
    let major = u32::from_str_radix(parts.next()?, 16).ok()?;
    let minor = u32::from_str_radix(parts.next()?, 16).ok()?;
    let inode = parts.next()?.parse::<u64>().ok()?;
    Some(FileId {
        major,
        minor,
        inode,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    fn lock_file(dir: &std::path::Path) -> (std::path::PathBuf, FileId) {
        let path = dir.join("lock");
        std::fs::write(&path, b"").expect("lock file");
        let file = FileId::of_path(&path).expect("stat");
        (path, file)
    }

    #[test]
    fn an_fdinfo_lock_line_of_the_file_proves_the_holder() {
        let file = FileId {
            major: 0,
            minor: 0x2d,
            inode: 42,
        };
        let held = "pos:\t0\nflags:\t0100000\nmnt_id:\t31\nino:\t42\nlock:\t1: FLOCK  ADVISORY  WRITE 77 00:2d:42 0 EOF\n";
        assert!(fdinfo_holds(held, file));
        let shared = held.replace("WRITE", "READ ");
        assert!(
            !fdinfo_holds(&shared, file),
            "a shared flock is no election"
        );
        let other = held.replace(":42 0 EOF", ":43 0 EOF");
        assert!(!fdinfo_holds(&other, file), "another file's lock");
        let posix = held.replace("FLOCK", "POSIX");
        assert!(!fdinfo_holds(&posix, file), "a POSIX lock is no election");
        assert!(!fdinfo_holds("pos:\t0\nflags:\t0100000\n", file));
    }

    #[test]
    fn a_process_holding_the_flock_is_found_without_proc_locks() {
        let dir = tempfile::tempdir().expect("temp dir");
        let (path, file) = lock_file(dir.path());
        let me = std::process::id();
        assert_eq!(held_by(me, file), Some(false), "nobody holds it yet");
        let f = std::fs::File::open(&path).expect("open");
        // SAFETY: flock on a descriptor this test owns.
        assert_eq!(unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) }, 0);
        assert_eq!(held_by(me, file), Some(true));
        drop(f);
        assert_eq!(
            held_by(me, file),
            Some(false),
            "closed, the lock went with it"
        );
        // A shared lock proves nothing.
        let f = std::fs::File::open(&path).expect("open");
        // SAFETY: as above.
        assert_eq!(unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_SH) }, 0);
        assert_eq!(held_by(me, file), Some(false));
        // A process that is gone holds nothing.
        assert_eq!(held_by(u32::MAX >> 1, file), Some(false));
    }

    /// A child holding the lock is found: among the children of the
    /// thread that made it (the first look, when that is the main
    /// thread), else among every thread's (here: a test's thread).
    #[test]
    fn a_child_holding_the_flock_is_found_from_its_parent() {
        let dir = tempfile::tempdir().expect("temp dir");
        let (path, file) = lock_file(dir.path());
        let me = std::process::id();
        // util-linux's flock(1) takes the lock and holds it while it runs.
        let mut child = std::process::Command::new("flock")
            .arg("-x")
            .arg(&path)
            .args(["sleep", "30"])
            .spawn()
            .expect("flock(1)");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        while held_by(me, file) != Some(true) {
            assert!(
                std::time::Instant::now() < deadline,
                "the child never held the lock"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        let tid = nix::unistd::gettid().as_raw() as u32;
        assert_eq!(thread_children(me, tid), Some(vec![child.id()]));
        let _ = child.kill();
        let _ = child.wait();
    }
}
