//! Who holds the election lock, and which slot that is. The kernel decides
//! the election; the shim only observes it, from `/proc/locks` (holder pid,
//! file identity) and `/proc/<pid>/cgroup` (which engine the pid belongs
//! to), so engines that never speak sd_notify are seen becoming active too.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

use shadow_pair::{parse_proc_lock_waiters, parse_proc_locks, FileId, LockHolder, SlotId};

use crate::error::{Error, Result};

/// Create the lock file (engines open it read-only, through a read-only
/// bind; nobody writes to it) and return its identity as `/proc/locks`
/// prints it.
pub fn create_lock_file(path: &Path) -> Result<FileId> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .map_err(|e| Error::io(format!("creating lock file {}", path.display()), e))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o644))
        .map_err(|e| Error::io(format!("chmod lock file {}", path.display()), e))?;
    let md = std::fs::metadata(path)
        .map_err(|e| Error::io(format!("stat lock file {}", path.display()), e))?;
    Ok(FileId::from_stat(md.dev(), md.ino()))
}

/// Which slot, if any, runs `pid`: the cgroup file names the engine's cgroup
/// (`<pair cgroup>/s0` or `/s1`) on some line.
pub fn slot_of_pid(pid: u32, engine_cgroups: &[String; 2]) -> Option<SlotId> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    slot_in_cgroup_text(&text, engine_cgroups)
}

pub fn slot_in_cgroup_text(text: &str, engine_cgroups: &[String; 2]) -> Option<SlotId> {
    for line in text.lines() {
        let Some(path) = line.splitn(3, ':').nth(2) else {
            continue;
        };
        for slot in SlotId::BOTH {
            let cg = &engine_cgroups[slot.index()];
            // The engine's own cgroup or a child an engine made below it.
            if path == cg || path.starts_with(&format!("{cg}/")) {
                return Some(slot);
            }
        }
    }
    None
}

/// What one look at `/proc/locks` says about the election lock.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LockSeen {
    /// Nobody holds it.
    Free,
    /// The engine of this slot holds it.
    Held(SlotId),
    /// Unreadable, or held by a process of no slot (yet): says nothing.
    Unknown,
}

impl LockSeen {
    /// As the pair judges a `READY=1` by it.
    pub fn holder(self) -> LockHolder {
        match self {
            LockSeen::Free => LockHolder::Free,
            LockSeen::Held(slot) => LockHolder::Slot(slot),
            LockSeen::Unknown => LockHolder::Unknown,
        }
    }
}

/// One look at `/proc/locks`: who holds the election lock, and which
/// engines wait for it (a waiting engine is parked, said or not).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LockLook {
    pub seen: LockSeen,
    /// Indexed by slot.
    pub waiting: [bool; 2],
}

impl LockLook {
    pub const UNKNOWN: LockLook = LockLook {
        seen: LockSeen::Unknown,
        waiting: [false, false],
    };
}

/// Who holds `file` exclusively now, and who waits for it.
pub fn observe(file: FileId, engine_cgroups: &[String; 2]) -> LockLook {
    let Ok(text) = std::fs::read_to_string("/proc/locks") else {
        return LockLook::UNKNOWN;
    };
    look_in(&text, file, |pid| slot_of_pid(pid, engine_cgroups))
}

fn look_in(text: &str, file: FileId, slot_of: impl Fn(u32) -> Option<SlotId>) -> LockLook {
    let mut waiting = [false, false];
    for w in parse_proc_lock_waiters(text) {
        if w.file == file {
            if let Some(slot) = slot_of(w.pid) {
                waiting[slot.index()] = true;
            }
        }
    }
    LockLook {
        seen: seen_in(text, file, &slot_of),
        waiting,
    }
}

fn seen_in(text: &str, file: FileId, slot_of: &impl Fn(u32) -> Option<SlotId>) -> LockSeen {
    let mut holders = parse_proc_locks(text)
        .into_iter()
        .filter(|h| h.file == file && h.exclusive)
        .peekable();
    if holders.peek().is_none() {
        return LockSeen::Free;
    }
    holders
        .find_map(|h| slot_of(h.pid))
        .map_or(LockSeen::Unknown, LockSeen::Held)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cgroup_lines_map_to_slots() {
        let cgs = ["/ns/c1/s0".to_string(), "/ns/c1/s1".to_string()];
        let v1 = "12:pids:/ns/c1/s1\n5:memory:/ns/c1/s1\n1:name=systemd:/x\n";
        assert_eq!(slot_in_cgroup_text(v1, &cgs), Some(SlotId::ONE));
        assert_eq!(
            slot_in_cgroup_text("0::/ns/c1/s0\n", &cgs),
            Some(SlotId::ZERO)
        );
        assert_eq!(slot_in_cgroup_text("0::/ns/c1/s00\n", &cgs), None);
        assert_eq!(slot_in_cgroup_text("0::/ns/c1\n", &cgs), None);
    }

    #[test]
    fn free_held_and_unknown_are_told_apart() {
        let file = FileId {
            major: 0xfd,
            minor: 1,
            inode: 42,
        };
        let line = |pid: u32| format!("1: FLOCK  ADVISORY  WRITE {pid} fd:01:42 0 EOF\n");
        let slot_of = |pid: u32| (pid == 7).then_some(SlotId::ONE);
        assert_eq!(seen_in("", file, &slot_of), LockSeen::Free);
        assert_eq!(
            seen_in(&line(7), file, &slot_of),
            LockSeen::Held(SlotId::ONE)
        );
        assert_eq!(seen_in(&line(8), file, &slot_of), LockSeen::Unknown);
        let other = "1: FLOCK  ADVISORY  WRITE 7 fd:01:43 0 EOF\n";
        assert_eq!(seen_in(other, file, &slot_of), LockSeen::Free);
    }

    #[test]
    fn waiters_of_the_election_lock_are_told_by_slot() {
        let file = FileId {
            major: 0xfd,
            minor: 1,
            inode: 42,
        };
        let slot_of = |pid: u32| match pid {
            7 => Some(SlotId::ZERO),
            8 => Some(SlotId::ONE),
            _ => None,
        };
        let text = "1: FLOCK  ADVISORY  WRITE 7 fd:01:42 0 EOF\n\
                    1: -> FLOCK  ADVISORY  WRITE 8 fd:01:42 0 EOF\n\
                    2: FLOCK  ADVISORY  WRITE 9 fd:01:43 0 EOF\n\
                    2: -> FLOCK  ADVISORY  WRITE 7 fd:01:43 0 EOF\n";
        let look = look_in(text, file, slot_of);
        assert_eq!(look.seen, LockSeen::Held(SlotId::ZERO));
        assert_eq!(
            look.waiting,
            [false, true],
            "a wait on another file is not ours"
        );
        let alone = look_in(
            "1: -> FLOCK  ADVISORY  WRITE 5 fd:01:42 0 EOF\n",
            file,
            slot_of,
        );
        assert_eq!(alone.waiting, [false, false], "a waiter of no slot");
    }

    /// Two real flocks on the lock file: the second waits, and is listed.
    #[test]
    fn a_real_waiter_is_listed() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("engine.lock");
        let id = create_lock_file(&p).unwrap();
        let held = nix::fcntl::Flock::lock(
            std::fs::File::open(&p).unwrap(),
            nix::fcntl::FlockArg::LockExclusive,
        )
        .map_err(|(_, e)| e)
        .unwrap();
        let path = p.clone();
        let waiter = std::thread::spawn(move || {
            // Blocks until `held` goes: a second open file description.
            let f = std::fs::File::open(&path).unwrap();
            nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusive)
                .map_err(|(_, e)| e)
                .unwrap()
        });
        let me = std::process::id();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            let text = std::fs::read_to_string("/proc/locks").unwrap();
            // Threads share our tgid: the waiter's pid is ours too.
            let look = look_in(&text, id, |pid| (pid == me).then_some(SlotId::ONE));
            if look.waiting == [false, true] {
                assert_eq!(look.seen, LockSeen::Held(SlotId::ONE));
                break;
            }
            assert!(std::time::Instant::now() < deadline, "no waiter in {text}");
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        drop(held);
        drop(waiter.join().unwrap());
    }

    #[test]
    fn a_real_flock_is_seen_with_its_file_identity() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("engine.lock");
        let id = create_lock_file(&p).unwrap();
        let f = std::fs::File::open(&p).unwrap();
        nix::fcntl::Flock::lock(f, nix::fcntl::FlockArg::LockExclusiveNonblock)
            .map(|held| {
                let text = std::fs::read_to_string("/proc/locks").unwrap();
                let holders = parse_proc_locks(&text);
                assert!(
                    holders
                        .iter()
                        .any(|h| h.file == id && h.pid == std::process::id() && h.exclusive),
                    "{text}"
                );
                drop(held);
            })
            .map_err(|(_, e)| e)
            .unwrap();
    }
}
