//! Who holds the election lock, from `/proc/locks`.
//!
//! An engine that does not speak sd_notify still takes the lock; the kernel
//! lists every `flock` with the holder's pid (in the reader's pid namespace,
//! so host pids for the shim) and the file's device and inode. Matching the
//! lock file's identity tells the shim which engine serves.

/// The lock file's identity (one definition, with gmsd's: the contract's).
pub use shadow_contract::lockfile::FileId;

/// One active exclusive or shared `flock`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct FlockHolder {
    pub pid: u32,
    pub file: FileId,
    pub exclusive: bool,
}

/// The granted `FLOCK` entries of a `/proc/locks` text. Waiters (lines with
/// `->`) and POSIX/OFD locks are skipped; malformed lines are ignored rather
/// than trusted.
pub fn parse_proc_locks(text: &str) -> Vec<FlockHolder> {
    entries(text, false)
}

/// The `FLOCK` requests still waiting (the kernel lists them under the lock
/// they wait for, as `N: -> FLOCK …`): a shadow blocked on the election
/// lock shows up here, which is how the shim sees it parked when it says
/// nothing on the notify socket.
pub fn parse_proc_lock_waiters(text: &str) -> Vec<FlockHolder> {
    entries(text, true)
}

fn entries(text: &str, waiters: bool) -> Vec<FlockHolder> {
    text.lines()
        .filter_map(|line| {
            let mut fields: Vec<&str> = line.split_whitespace().collect();
            // "1: FLOCK  ADVISORY  WRITE 1234 00:1a:5678 0 EOF", and a
            // waiter: "1: -> FLOCK  ADVISORY  WRITE 1235 00:1a:5678 0 EOF".
            let waiting = fields.get(1) == Some(&"->");
            if waiting != waiters {
                return None;
            }
            if waiting {
                fields.remove(1);
            }
            flock_entry(&fields)
        })
        .collect()
}

fn flock_entry(fields: &[&str]) -> Option<FlockHolder> {
    if fields.len() < 6 || fields[1] != "FLOCK" {
        return None;
    }
    let exclusive = match fields[3] {
        "WRITE" => true,
        "READ" => false,
        _ => return None,
    };
    let pid = fields[4].parse::<u32>().ok()?;
    let mut id = fields[5].split(':');
    let (Some(maj), Some(min), Some(ino), None) = (id.next(), id.next(), id.next(), id.next())
    else {
        return None;
    };
    Some(FlockHolder {
        pid,
        file: FileId {
            major: u32::from_str_radix(maj, 16).ok()?,
            minor: u32::from_str_radix(min, 16).ok()?,
            inode: ino.parse::<u64>().ok()?,
        },
        exclusive,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const SAMPLE: &str = "\
1: POSIX  ADVISORY  WRITE 812 00:19:2291 0 EOF
2: FLOCK  ADVISORY  WRITE 4242 00:2a:1577 0 EOF
2: -> FLOCK  ADVISORY  WRITE 4243 00:2a:1577 0 EOF
3: FLOCK  ADVISORY  READ 77 fd:01:99 0 EOF
4: OFDLCK ADVISORY  READ -1 00:06:9 0 EOF
garbage
5: FLOCK  ADVISORY  WRITE notapid 00:2a:1 0 EOF
";

    #[test]
    fn granted_flocks_only() {
        let h = parse_proc_locks(SAMPLE);
        assert_eq!(h.len(), 2, "{h:?}");
        assert_eq!(
            h[0],
            FlockHolder {
                pid: 4242,
                file: FileId {
                    major: 0,
                    minor: 0x2a,
                    inode: 1577
                },
                exclusive: true
            }
        );
        assert_eq!(
            h[1].file,
            FileId {
                major: 0xfd,
                minor: 1,
                inode: 99
            }
        );
        assert!(!h[1].exclusive);
    }

    #[test]
    fn waiters_only() {
        let w = parse_proc_lock_waiters(SAMPLE);
        assert_eq!(w.len(), 1, "{w:?}");
        assert_eq!(w[0].pid, 4243);
        assert_eq!(w[0].file, parse_proc_locks(SAMPLE)[0].file);
        assert!(w[0].exclusive);
        assert!(parse_proc_lock_waiters("1: -> FLOCK ADVISORY WRITE x 0:1:2 0 EOF").is_empty());
    }

    #[test]
    fn dev_numbers_decode_like_glibc() {
        // makedev(0, 42) and makedev(253, 1) in the kernel's 32-bit encoding.
        assert_eq!(
            FileId::from_stat(42, 7),
            FileId {
                major: 0,
                minor: 42,
                inode: 7
            }
        );
        assert_eq!(
            FileId::from_stat((253 << 8) | 1, 7),
            FileId {
                major: 253,
                minor: 1,
                inode: 7
            }
        );
    }
}
