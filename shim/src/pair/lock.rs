//! Who holds the election lock, and which slot that is. The kernel decides
//! the election; the shim only observes it, from `/proc/locks` (holder pid,
//! file identity) and `/proc/<pid>/cgroup` (which engine the pid belongs
//! to), so engines that never speak sd_notify are seen becoming active too.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

use shadow_pair::{
    parse_proc_lock_waiters, parse_proc_locks, FileId, LockHolder, SlotId, MAX_SLOTS,
};

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
/// (`<pair cgroup>/s0` … `/sN`, indexed by slot) on some line.
pub fn slot_of_pid(pid: u32, engine_cgroups: &[String]) -> Option<SlotId> {
    let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    slot_in_cgroup_text(&text, engine_cgroups)
}

pub fn slot_in_cgroup_text(text: &str, engine_cgroups: &[String]) -> Option<SlotId> {
    for line in text.lines() {
        let Some(path) = line.splitn(3, ':').nth(2) else {
            continue;
        };
        for slot in SlotId::first(engine_cgroups.len()) {
            let cg = &engine_cgroups[slot.index()];
            // The engine's own cgroup or a child an engine made below it.
            if path == cg || path.starts_with(&format!("{cg}/")) {
                return Some(slot);
            }
        }
    }
    None
}

/// Whether `pid`, or a child of it, holds the election lock `file`
/// through a descriptor it has open: a proof that costs no read of
/// `/proc/locks` (see [`gms::holder`], which gmsd asks too, for the write
/// lease of the pair's KV pool).
pub fn held_by(pid: u32, file: FileId) -> Option<bool> {
    gms::holder::held_by(pid, file)
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
    /// Indexed by slot (room for every slot a pair may have).
    pub waiting: [bool; MAX_SLOTS],
}

impl LockLook {
    pub const UNKNOWN: LockLook = LockLook {
        seen: LockSeen::Unknown,
        waiting: [false; MAX_SLOTS],
    };
}

/// Who holds `file` exclusively now, and who waits for it.
///
/// A holder seen is certain: the kernel renders each record whole. A lock
/// not seen may have been skipped (see [`read_proc_locks`]), so a look that
/// finds the lock free is taken only when a second read agrees; whatever
/// either read saw held or waiting stands.
pub fn observe(file: FileId, engine_cgroups: &[String]) -> LockLook {
    observe_by(read_proc_locks, file, |pid| {
        slot_of_pid(pid, engine_cgroups)
    })
}

fn observe_by(
    mut read: impl FnMut() -> std::io::Result<String>,
    file: FileId,
    slot_of: impl Fn(u32) -> Option<SlotId>,
) -> LockLook {
    let mut look = || match read() {
        Ok(text) => look_in(&text, file, &slot_of),
        Err(_) => LockLook::UNKNOWN,
    };
    let first = look();
    if first.seen != LockSeen::Free {
        return first;
    }
    let second = look();
    LockLook {
        seen: second.seen,
        waiting: std::array::from_fn(|i| first.waiting[i] || second.waiting[i]),
    }
}

/// What one read(2) of `/proc/locks` is given room for: more than the page
/// the kernel renders per call.
const PROC_LOCKS_READ: usize = 64 << 10;

/// The text of `/proc/locks`.
///
/// The kernel renders it a page per read(2), each page under its lock-list
/// lock, and finds where to go on by counting records again. A lock taken
/// or dropped anywhere on the host between two reads shifts that count, and
/// a record can be skipped. `read_to_string` makes this likely: its first
/// read(2) is a 32-byte probe, which splits even a one-record text in two
/// (`a_held_lock_is_in_every_read_while_others_churn`: 8 to 12 of 20 000
/// such reads missed a held lock while two threads took and dropped
/// others). Reading with room for a whole page makes a text of one page
/// (about 80 locks) a single, consistent read.
fn read_proc_locks() -> std::io::Result<String> {
    use std::io::Read;
    let mut bytes = Vec::with_capacity(PROC_LOCKS_READ);
    std::fs::File::open("/proc/locks")?.read_to_end(&mut bytes)?;
    String::from_utf8(bytes).map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidData, e))
}

fn look_in(text: &str, file: FileId, slot_of: &impl Fn(u32) -> Option<SlotId>) -> LockLook {
    let mut waiting = [false; MAX_SLOTS];
    for w in parse_proc_lock_waiters(text) {
        if w.file == file {
            if let Some(slot) = slot_of(w.pid) {
                waiting[slot.index()] = true;
            }
        }
    }
    LockLook {
        seen: seen_in(text, file, slot_of),
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

    /// The proof is gms's ([`gms::holder`], tested there); here only
    /// that the shim's file identity reaches it whole.
    #[test]
    fn the_shims_lock_file_is_the_one_proven() {
        use std::os::fd::AsRawFd;
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("lock");
        let file = create_lock_file(&path).expect("lock file");
        let me = std::process::id();
        assert_eq!(held_by(me, file), Some(false), "nobody holds it yet");
        let f = std::fs::File::open(&path).expect("open");
        // SAFETY: flock on a descriptor this test owns.
        assert_eq!(unsafe { libc::flock(f.as_raw_fd(), libc::LOCK_EX) }, 0);
        assert_eq!(held_by(me, file), Some(true));
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
        let look = look_in(text, file, &slot_of);
        assert_eq!(look.seen, LockSeen::Held(SlotId::ZERO));
        assert_eq!(
            look.waiting[..2],
            [false, true],
            "a wait on another file is not ours"
        );
        let alone = look_in(
            "1: -> FLOCK  ADVISORY  WRITE 5 fd:01:42 0 EOF\n",
            file,
            &slot_of,
        );
        assert_eq!(alone.waiting, [false; MAX_SLOTS], "a waiter of no slot");
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
        let found = shadow_wait::poll(
            std::time::Duration::from_secs(10),
            std::time::Duration::from_millis(5),
            || {
                let text = read_proc_locks().unwrap();
                // Threads share our tgid: the waiter's pid is ours too.
                let look = look_in(&text, id, &|pid| (pid == me).then_some(SlotId::ONE));
                if look.waiting[..2] == [false, true] {
                    Ok(look)
                } else {
                    Err(text)
                }
            },
        );
        match found {
            Ok(look) => assert_eq!(look.seen, LockSeen::Held(SlotId::ONE)),
            Err(text) => panic!("no waiter in {text}"),
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
                let text = read_proc_locks().unwrap();
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

    /// A look that finds the lock free reads again: the record may have
    /// been skipped. What either read saw held or waiting stands.
    #[test]
    fn a_free_lock_is_read_twice_before_it_is_believed() {
        let file = FileId {
            major: 0xfd,
            minor: 1,
            inode: 42,
        };
        let slot_of = |pid: u32| (pid == 7).then_some(SlotId::ONE);
        let held = "1: FLOCK  ADVISORY  WRITE 7 fd:01:42 0 EOF\n";
        let waits = "1: -> FLOCK  ADVISORY  WRITE 7 fd:01:42 0 EOF\n";
        let reads = |texts: Vec<&'static str>| {
            let mut texts = texts.into_iter();
            let mut count = 0;
            let look = observe_by(
                || {
                    count += 1;
                    texts
                        .next()
                        .map(str::to_owned)
                        .ok_or_else(|| std::io::Error::other("unreadable"))
                },
                file,
                slot_of,
            );
            (look, count)
        };
        let (look, n) = reads(vec![held]);
        assert_eq!((look.seen, n), (LockSeen::Held(SlotId::ONE), 1));
        let (look, n) = reads(vec!["", held]);
        assert_eq!((look.seen, n), (LockSeen::Held(SlotId::ONE), 2));
        let (look, n) = reads(vec!["", ""]);
        assert_eq!((look.seen, n), (LockSeen::Free, 2));
        let (look, _) = reads(vec![waits, ""]);
        assert_eq!(look.waiting[..2], [false, true]);
        let (look, n) = reads(vec![]);
        assert_eq!((look, n), (LockLook::UNKNOWN, 1), "unreadable says nothing");
    }

    /// Locks taken and dropped elsewhere while `/proc/locks` is read must
    /// not hide one that is held: read with `read_to_string`, 8 to 12 of
    /// these 20 000 reads missed it.
    #[test]
    fn a_held_lock_is_in_every_read_while_others_churn() {
        use std::sync::atomic::{AtomicBool, Ordering};
        let d = tempfile::tempdir().unwrap();
        let id = create_lock_file(&d.path().join("engine.lock")).unwrap();
        let held = nix::fcntl::Flock::lock(
            std::fs::File::open(d.path().join("engine.lock")).unwrap(),
            nix::fcntl::FlockArg::LockExclusiveNonblock,
        )
        .map_err(|(_, e)| e)
        .unwrap();
        let stop = std::sync::Arc::new(AtomicBool::new(false));
        let churners: Vec<_> = (0..2)
            .map(|i| {
                let f = std::fs::File::create(d.path().join(format!("other{i}"))).unwrap();
                let stop = stop.clone();
                std::thread::spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        f.lock().unwrap();
                        f.unlock().unwrap();
                    }
                })
            })
            .collect();
        let me = std::process::id();
        let missed = (0..20_000)
            .filter(|_| {
                let text = read_proc_locks().unwrap();
                !parse_proc_locks(&text)
                    .iter()
                    .any(|h| h.file == id && h.pid == me)
            })
            .count();
        stop.store(true, Ordering::Relaxed);
        for c in churners {
            c.join().unwrap();
        }
        drop(held);
        assert_eq!(missed, 0, "reads of /proc/locks that missed a held lock");
    }
}
