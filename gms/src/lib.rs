//! GPU Memory Service (GMS): owns weights outside any engine process.
//!
//! One `gmsd` per device owns every physical allocation. Engines connect over
//! a Unix socket; the connection *is* the lease (`rw`, `ro`, `rw_or_ro`), and
//! allocations travel as file descriptors. Weights therefore outlive the
//! engine that loaded them, and a shadow engine maps them at the same
//! virtual addresses in milliseconds. See `docs/gms-protocol.md`.
//!
//! Layers, each in its own module:
//! - [`protocol`]: versioned JSON messages and the pure decoder;
//! - [`wire`]: framing and `SCM_RIGHTS` over a stream socket;
//! - [`lease`]: the lease state machine (pure logic);
//! - [`layout`]: allocations, metadata and the committed layout;
//! - [`backend`]: the physical memory behind allocations (`host`, `cuda`);
//! - [`daemon`]: `gmsd` itself; [`status`]: what it reports;
//! - [`client`] and [`mapper`]: the engine side; [`cuda_mapper`] maps on a GPU.

pub mod backend;
pub mod client;
pub mod cuda_mapper;
pub mod daemon;
mod error;
pub mod fuzz;
pub mod layout;
pub mod lease;
pub mod mapper;
pub mod protocol;
pub mod status;
pub mod wire;

pub use error::{Error, Result};

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
