//! The pair's file-descriptor store (`shadow.dev/fdstore-max`, config
//! `pair.fdstore_max`): its names and bounds, shared by the shim's store and
//! the engines' side of it (`shadow-engine-kit`'s `fdstore`). It is
//! systemd's store (`sd_notify(3)`, `systemd.service(5)`
//! `FileDescriptorStoreMax=`) for a pair of engines:
//!
//! - an engine stores descriptors by sending `FDSTORE=1` (with `FDNAME=`,
//!   and `FDPOLL=0` to keep a socket whose peer hung up) and the
//!   descriptors (`SCM_RIGHTS`) on `NOTIFY_SOCKET`, and drops them by name
//!   with `FDSTOREREMOVE=1` and `FDNAME=`; only sockets and memfds are
//!   kept;
//! - every engine the pair starts gets the store after the listening
//!   sockets, in `LISTEN_FDS`/`LISTEN_FDNAMES`, as systemd hands it to a
//!   restarted service;
//! - an engine that takes the election lock is already running: it fetches
//!   the store from its `SHADOW_FDSTORE_SOCKET`, which answers the lock
//!   holder only, once everything the engines sent before is in.
//!
//! The fetch socket is a `SOCK_SEQPACKET` Unix socket; the client sends
//! nothing. Each packet is one line of text: `FDNAMES=<name>:<name>…` with
//! as many descriptors as names (at most [`FDS_PER_PACKET`]), then
//! `END=<count>` with the total, or `ERROR=<why>` alone.

use crate::error::AnnotationError;

/// The annotation: how many descriptors a pair's store keeps at most.
pub const KEY: &str = "shadow.dev/fdstore-max";
/// Without the annotation: room for one connection and its state each for
/// a few hundred clients (systemd's own default is 0, no store).
pub const DEFAULT_MAX: u32 = 1024;
/// The largest value allowed. Every stored descriptor is one open file of
/// the shim (containerd starts its shims with a limit of 1 048 576).
pub const MAX_MAX: u32 = 16384;
/// A stored descriptor without `FDNAME=` is named so (systemd's name).
pub const DEFAULT_NAME: &str = "stored";
/// Longest name (systemd's `FDNAME=` bound).
pub const NAME_MAX: usize = 255;
/// Descriptors in one packet of a fetch.
pub const FDS_PER_PACKET: usize = 64;
/// The largest packet of a fetch: the names of [`FDS_PER_PACKET`]
/// descriptors, separators and the key.
pub const PACKET_MAX: usize = FDS_PER_PACKET * (NAME_MAX + 1) + 64;

/// `shadow.dev/fdstore-max`: `0` (no store: descriptors sent are refused
/// by the kernel, as before the store) to [`MAX_MAX`].
pub fn parse_max(value: &str) -> Result<u32, AnnotationError> {
    let t = value.trim();
    match t.parse::<u32>() {
        Ok(n) if t.bytes().all(|b| b.is_ascii_digit()) && n <= MAX_MAX => Ok(n),
        _ => Err(AnnotationError {
            key: KEY.to_string(),
            value: value.to_string(),
            allowed: format!("0 (no store) to {MAX_MAX}"),
        }),
    }
}

/// Whether `name` may name stored descriptors: 1 to [`NAME_MAX`]
/// printable ASCII characters, no `:` (it separates `LISTEN_FDNAMES`), as
/// systemd's `fdname_is_valid`.
pub fn name_is_valid(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= NAME_MAX
        && name.bytes().all(|b| (0x20..0x7f).contains(&b) && b != b':')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_bound_parses_from_zero_to_its_maximum() {
        assert_eq!(parse_max("0"), Ok(0));
        assert_eq!(parse_max(" 4096 "), Ok(4096));
        assert_eq!(parse_max(&MAX_MAX.to_string()), Ok(MAX_MAX));
        for bad in ["", "-1", "+5", "16385", "1e3", "many"] {
            let e = parse_max(bad).unwrap_err();
            assert_eq!(e.key, KEY);
            assert!(e.allowed.contains("16384"), "{e}");
        }
    }

    #[test]
    fn names_are_systemds() {
        assert!(name_is_valid("conn-17"));
        assert!(name_is_valid(&"x".repeat(NAME_MAX)));
        for bad in ["", "a:b", "tab\there", "é", "new\nline"] {
            assert!(!name_is_valid(bad), "{bad:?}");
        }
        assert!(!name_is_valid(&"x".repeat(NAME_MAX + 1)));
    }
}
