//! Keeping the resident shim small. The shim idles for the life of a pod,
//! but its startup (flag parsing, logger, ttrpc setup) and each Create fault
//! in code pages of the executable, 64 KiB at a time through the kernel's
//! fault-around, that are then not used again. `trim` asks the kernel to
//! drop this process's resident pages of its own executable
//! (`MADV_PAGEOUT`): clean file pages, re-read from the page cache if they
//! are needed again, so the cost is a few minor faults. Pages shared with
//! other processes (libc) are left alone by the kernel.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// How long the shim must be quiet before trimming. Short: the reply to the
/// request that asked for it is sent first, and a container that exits at
/// once pays only a few minor faults to bring back what its exit needs.
const IDLE_BEFORE_TRIM: Duration = Duration::from_millis(2);

static GENERATION: AtomicU64 = AtomicU64::new(0);

/// Trim once no other `trim_when_idle` has been asked for `IDLE_BEFORE_TRIM`.
pub fn trim_when_idle() {
    let mine = GENERATION.fetch_add(1, Ordering::SeqCst) + 1;
    tokio::spawn(async move {
        tokio::time::sleep(IDLE_BEFORE_TRIM).await;
        if GENERATION.load(Ordering::SeqCst) == mine {
            trim();
        }
    });
}

/// Drop resident pages of our own executable's read-only mappings.
pub fn trim() {
    let Ok(exe) = std::fs::read_link("/proc/self/exe") else {
        return;
    };
    let Ok(maps) = std::fs::read_to_string("/proc/self/maps") else {
        return;
    };
    for (start, end) in exe_ranges(&maps, &exe.to_string_lossy()) {
        // SAFETY: the range is a whole mapping of our executable read from
        // /proc/self/maps; MADV_PAGEOUT only drops clean pages, which the
        // kernel faults back in on access, so no memory we use is changed.
        let rc =
            unsafe { libc::madvise(start as *mut libc::c_void, end - start, libc::MADV_PAGEOUT) };
        if rc != 0 {
            // Older kernels (< 5.4) lack MADV_PAGEOUT: nothing to do.
            return;
        }
    }
}

/// Ranges of read-only (text and rodata) mappings of `exe` in a maps listing.
fn exe_ranges(maps: &str, exe: &str) -> Vec<(usize, usize)> {
    maps.lines()
        .filter_map(|line| {
            let mut f = line.split_whitespace();
            let range = f.next()?;
            let perms = f.next()?;
            let path = f.nth(3)?;
            if path != exe || perms.contains('w') {
                return None;
            }
            let (a, b) = range.split_once('-')?;
            Some((
                usize::from_str_radix(a, 16).ok()?,
                usize::from_str_radix(b, 16).ok()?,
            ))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_only_read_only_mappings_of_the_executable() {
        let maps = "\
55ff0000-55ff1000 r--p 00000000 fe:00 1 /usr/bin/shim
55ff1000-55ff5000 r-xp 00001000 fe:00 1 /usr/bin/shim
55ff5000-55ff6000 rw-p 00005000 fe:00 1 /usr/bin/shim
7f000000-7f001000 r-xp 00000000 fe:00 2 /usr/lib/libc.so.6
7f002000-7f003000 rw-p 00000000 00:00 0 [heap]
";
        assert_eq!(
            exe_ranges(maps, "/usr/bin/shim"),
            vec![(0x55ff0000, 0x55ff1000), (0x55ff1000, 0x55ff5000)]
        );
    }
}
