//! `gmsd`, the GPU Memory Service daemon: one per device, owner of every
//! physical allocation of an engine pair, so that weights outlive the engine
//! that loaded them. Engines reach it through the `gms` crate (protocol and
//! client); this crate is what only the daemon and its tools need, kept
//! apart so that a client never links it. See `docs/gms-protocol.md`.
//!
//! Layers, each in its own module:
//! - [`lease`]: the lease state machine (pure logic);
//! - [`backend`]: the physical memory behind allocations (`host`, `cuda`);
//! - [`daemon`]: the accept loop, peer checks, limits, one thread per lease;
//! - [`fuzz`]: the stable-toolchain fuzzer of the decoder and lease machine;
//! - [`parse_bytes`]: byte counts on the binaries' command lines.

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

#[cfg(test)]
mod tests {
    use super::parse_bytes;

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
