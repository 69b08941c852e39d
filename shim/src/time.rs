//! Time as containerd's messages carry it. Both container kinds, the
//! service and the `delete` action stamp exits; the conversion lives at the
//! bottom of the shim so that none of them has to reach up for it.

use std::time::{SystemTime, UNIX_EPOCH};

use containerd_shim_protos::protobuf::well_known_types::timestamp::Timestamp;

/// `t` as a protobuf `Timestamp` (a time before the epoch becomes the epoch).
pub fn timestamp(t: SystemTime) -> Timestamp {
    let d = t.duration_since(UNIX_EPOCH).unwrap_or_default();
    Timestamp {
        seconds: d.as_secs() as i64,
        nanos: d.subsec_nanos() as i32,
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timestamps_convert_exactly() {
        let t = UNIX_EPOCH + std::time::Duration::new(1_700_000_000, 123);
        let ts = timestamp(t);
        assert_eq!((ts.seconds, ts.nanos), (1_700_000_000, 123));
    }

    #[test]
    fn time_before_the_epoch_is_the_epoch() {
        let ts = timestamp(UNIX_EPOCH - std::time::Duration::from_secs(5));
        assert_eq!((ts.seconds, ts.nanos), (0, 0));
    }
}
