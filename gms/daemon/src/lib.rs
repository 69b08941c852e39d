//! `gmsd`, the GPU Memory Service daemon: one per device, owner of every
//! physical allocation of an engine pair, so that weights outlive the engine
//! that loaded them. Engines reach it through the `gms` crate (protocol and
//! client); this crate is what only the daemon and its tools need, kept
//! apart so that a client never links it. See `docs/gms-protocol.md`.
//!
//! Layers, each in its own module:
//! - [`lease`]: the lease state machine (pure logic);
//! - [`backend`]: the physical memory behind allocations (`host`, `cuda`);
//! - [`daemon`]: the accept loop, peer checks, limits, one thread per lease
//!   (one file per job under `daemon/`);
//! - [`fuzz`]: the stable-toolchain fuzzer of the decoder and lease machine;
//! - [`parse_bytes`], [`parse_duration`]: sizes and times on the binaries'
//!   command lines.

pub mod backend;
pub mod daemon;
pub mod fuzz;
pub mod lease;

/// Parses a byte count such as `4096`, `64M`, `16G` or `1T` (binary units).
pub fn parse_bytes(text: &str) -> std::result::Result<u64, String> {
    let text = text.trim();
    let (digits, shift) = match text.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let shift = match c.to_ascii_uppercase() {
                'K' => 10,
                'M' => 20,
                'G' => 30,
                'T' => 40,
                _ => return Err(format!("unknown unit '{c}' in '{text}' (use K, M, G or T)")),
            };
            (&text[..i], shift)
        }
        _ => (text, 0),
    };
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("'{text}' is not a byte count"))?;
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| format!("'{text}' does not fit in 64 bits"))
}

/// Parses a duration such as `300s`, `500ms`, `5m` or `1h` (a bare
/// number is seconds).
pub fn parse_duration(text: &str) -> std::result::Result<std::time::Duration, String> {
    let text = text.trim();
    let split = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (digits, unit) = text.split_at(split);
    let n: u64 = digits
        .parse()
        .map_err(|_| format!("'{text}' is not a duration (e.g. 500ms, 10s, 5m)"))?;
    let ms = match unit {
        "ms" => Some(n),
        "" | "s" => n.checked_mul(1000),
        "m" => n.checked_mul(60_000),
        "h" => n.checked_mul(3_600_000),
        _ => {
            return Err(format!(
                "unknown unit '{unit}' in '{text}' (use ms, s, m or h)"
            ))
        }
    };
    ms.map(std::time::Duration::from_millis)
        .ok_or_else(|| format!("'{text}' is too long"))
}

#[cfg(test)]
mod tests {
    use super::{parse_bytes, parse_duration};
    use std::time::Duration;

    #[test]
    fn durations_parse_with_units() {
        assert_eq!(parse_duration("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(parse_duration("10"), Ok(Duration::from_secs(10)));
        assert_eq!(parse_duration("5m"), Ok(Duration::from_secs(300)));
        assert!(parse_duration("5d").is_err());
        assert!(parse_duration("").is_err());
        assert!(parse_duration("99999999999999999h").is_err());
    }

    #[test]
    fn byte_counts_parse_with_units() {
        assert_eq!(parse_bytes("4096"), Ok(4096));
        assert_eq!(parse_bytes("64M"), Ok(64 << 20));
        assert_eq!(parse_bytes("16g"), Ok(16 << 30));
        assert!(parse_bytes("12X").is_err());
        assert!(parse_bytes("").is_err());
        assert!(parse_bytes("99999999999T").is_err());
    }
}
