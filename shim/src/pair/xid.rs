//! NVIDIA XIDs for the pair's GPUs, from the kernel log.
//!
//! The driver reports GPU faults as `NVRM: Xid (PCI:<bus>): <n>, …` lines in
//! the kernel ring buffer. Whether a fault leaves GMS memory valid decides
//! between a failover and a cold restart of the pair (`shadow_pair::XidClass`),
//! so the shim follows `/dev/kmsg` for as long as a pair with GPUs lives and
//! reports the XIDs of that pair's GPUs only: those the spec's devices grant,
//! with their PCI bus ids from the driver's proc directory (`gpus.rs`), so no
//! NVML is needed.

use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use nix::poll::{poll, PollFd, PollFlags, PollTimeout};

/// The XID of a kernel log record, with the PCI bus of the GPU, if the record
/// is an NVRM XID report. Accepts both a raw `/dev/kmsg` record
/// (`6,1234,5678,-;NVRM: …`) and a `dmesg` line.
pub fn parse_xid(record: &str) -> Option<(String, u32)> {
    let rest = &record[record.find("NVRM: Xid (")? + "NVRM: Xid (".len()..];
    let (inside, after) = rest.split_once("):")?;
    let bus = inside.strip_prefix("PCI:").unwrap_or(inside).trim();
    let number = after
        .trim_start()
        .split(|c: char| !c.is_ascii_digit())
        .next()?
        .parse()
        .ok()?;
    Some((normalise_bus(bus), number))
}

/// `0000:3B:00.0` and `0000:3b:00` name the same GPU.
pub(super) fn normalise_bus(bus: &str) -> String {
    let lower = bus.to_ascii_lowercase();
    match lower.rsplit_once('.') {
        Some((head, func)) if func.chars().all(|c| c.is_ascii_digit()) => head.to_string(),
        _ => lower,
    }
}

/// Follows `/dev/kmsg` on a thread until `stop` is set, calling `report` for
/// each XID on one of `buses`. Only records written after the start are
/// read. Returns without a thread when the log cannot be opened (logged).
pub fn watch(buses: Vec<String>, stop: Arc<AtomicBool>, report: impl Fn(u32) + Send + 'static) {
    if buses.is_empty() {
        return;
    }
    let file = match std::fs::File::open("/dev/kmsg") {
        Ok(f) => f,
        Err(e) => {
            log::warn!("XID watch: opening /dev/kmsg: {e}; GPU faults will not be classified");
            return;
        }
    };
    // SAFETY: lseek on a descriptor we own; SEEK_END on /dev/kmsg moves past
    // the records already in the buffer.
    unsafe { libc::lseek(std::os::fd::AsRawFd::as_raw_fd(&file), 0, libc::SEEK_END) };
    let spawned = std::thread::Builder::new()
        .name("xid-watch".into())
        .spawn(move || {
            use std::io::Read;
            let mut file = file;
            let mut buf = vec![0u8; 8192];
            while !stop.load(Ordering::Relaxed) {
                let mut fds = [PollFd::new(file.as_fd(), PollFlags::POLLIN)];
                match poll(&mut fds, PollTimeout::from(500u16)) {
                    Ok(0) => continue,
                    Ok(_) => {}
                    Err(nix::errno::Errno::EINTR) => continue,
                    Err(e) => {
                        log::warn!("XID watch: poll /dev/kmsg: {e}");
                        return;
                    }
                }
                // One read returns one record; EPIPE means records were
                // overwritten before we read them: carry on.
                match file.read(&mut buf) {
                    Ok(n) => {
                        let text = String::from_utf8_lossy(&buf[..n]);
                        if let Some((bus, xid)) = parse_xid(&text) {
                            if buses.contains(&bus) {
                                report(xid);
                            }
                        }
                    }
                    Err(e) if e.raw_os_error() == Some(libc::EPIPE) => continue,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(e) => {
                        log::warn!("XID watch: reading /dev/kmsg: {e}");
                        return;
                    }
                }
            }
        });
    if let Err(e) = spawned {
        log::warn!("XID watch: starting its thread: {e}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_kmsg_records_and_dmesg_lines() {
        assert_eq!(
            parse_xid("4,1021,93871233,-;NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python3, GPU has fallen off the bus."),
            Some(("0000:3b:00".into(), 79))
        );
        assert_eq!(
            parse_xid("[12345.6789] NVRM: Xid (PCI:0000:C1:00): 13, Graphics Exception: ESR 0x404600=0x80000002"),
            Some(("0000:c1:00".into(), 13))
        );
        assert_eq!(
            parse_xid("NVRM: Xid (0000:c1:00.0): 48, An uncorrectable double bit error"),
            Some(("0000:c1:00".into(), 48))
        );
        assert_eq!(
            parse_xid("6,1,2,-;NVRM: loading NVIDIA UNIX x86_64 Kernel Module 580.159.04"),
            None
        );
        assert_eq!(parse_xid("NVRM: Xid (PCI:0000:3b:00): , garbage"), None);
        assert_eq!(parse_xid("usb 1-1: new high-speed USB device"), None);
    }
}
