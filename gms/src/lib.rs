//! GPU Memory Service (GMS), the side every peer of `gmsd` shares: the wire
//! protocol and the engine-side client.
//!
//! One `gmsd` per device owns every physical allocation. Engines connect over
//! a Unix socket; the connection *is* the lease (`rw`, `ro`, `rw_or_ro`), and
//! allocations travel as file descriptors. Weights therefore outlive the
//! engine that loaded them, and a shadow engine maps them at the same
//! virtual addresses in milliseconds. See `docs/gms-protocol.md`.
//!
//! This crate exists apart from the daemon (crate `gmsd`, in `gms/daemon`)
//! so that whoever only talks to a daemon — an engine, the shim asking for a
//! status report, the tests — links neither the daemon, nor the CUDA driver
//! bindings, nor a CLI parser. On a GPU, `gms-cuda` adds the CUDA mapper.
//!
//! Layers, each in its own module:
//! - [`protocol`]: versioned JSON messages and the pure decoder;
//! - [`wire`]: framing and `SCM_RIGHTS` over a stream socket;
//! - [`layout`]: allocations, metadata and the committed layout;
//! - [`status`]: what a daemon reports;
//! - [`client`] and [`mapper`]: the engine side (host memory mapper).

pub mod client;
mod error;
pub mod layout;
pub mod mapper;
pub mod protocol;
pub mod status;
pub mod wire;

pub use error::{Error, Result};
pub use mapper::Access;

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
