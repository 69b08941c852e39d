//! Who holds the election lock, and which slot that is. The kernel decides
//! the election; the shim only observes it, from `/proc/locks` (holder pid,
//! file identity) and `/proc/<pid>/cgroup` (which engine the pid belongs
//! to), so engines that never speak sd_notify are seen becoming active too.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

use shadow_pair::{parse_proc_locks, FileId, SlotId};

use crate::error::{Error, Result};

/// Create the lock file (engines open it; nobody writes to it) and return
/// its identity as `/proc/locks` prints it.
pub fn create_lock_file(path: &Path) -> Result<FileId> {
    use std::os::unix::fs::PermissionsExt;
    std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(path)
        .map_err(|e| Error::io(format!("creating lock file {}", path.display()), e))?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666))
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

/// The slot whose engine holds `file` exclusively now.
pub fn holder(file: FileId, engine_cgroups: &[String; 2]) -> Option<SlotId> {
    let text = std::fs::read_to_string("/proc/locks").ok()?;
    parse_proc_locks(&text)
        .into_iter()
        .filter(|h| h.file == file && h.exclusive)
        .find_map(|h| slot_of_pid(h.pid, engine_cgroups))
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
