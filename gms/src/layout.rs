//! What a lease sees: allocations (id, tag, size, address) and key/value
//! metadata. A writer builds one; `commit` freezes it into the layout that
//! readers import. Pure data and its rules; the memory behind each
//! allocation lives in the daemon next to it.

use serde::{Deserialize, Serialize};

use crate::{Error, Result};

// An allocation is shared vocabulary (the status report lists them too);
// it keeps its path here.
pub use crate::types::Allocation;
use crate::types::Metadata;

/// Highest user-space address on x86-64 (47-bit) and aarch64 (48-bit
/// configurations start lower, but the kernel refuses those anyway).
pub const MAX_USER_ADDRESS: u64 = 0x0000_7fff_ffff_f000;

/// Bounds on what a writer may put in a layout.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
pub struct MetadataLimits {
    pub max_entries: usize,
    pub max_bytes: usize,
}

#[derive(Serialize, Deserialize, Clone, Debug, Default, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Layout {
    /// Bumped on every commit, so a reader can tell layouts apart.
    pub generation: u64,
    pub allocations: Vec<Allocation>,
    pub metadata: Metadata,
}

impl Layout {
    pub fn bytes(&self) -> u64 {
        self.allocations.iter().map(|a| a.size).sum()
    }

    pub fn get(&self, id: u64) -> Option<&Allocation> {
        self.allocations.iter().find(|a| a.id == id)
    }

    /// Adds an allocation unless its address range overlaps another one:
    /// readers map every allocation at its address, so ranges must be disjoint.
    pub fn insert(&mut self, alloc: Allocation) -> Result<()> {
        if alloc.va == 0
            || alloc
                .va
                .checked_add(alloc.size)
                .is_none_or(|end| end > MAX_USER_ADDRESS)
        {
            return Err(Error::AddressConflict(format!(
                "allocation of {} bytes at {:#x} is outside user address space",
                alloc.size, alloc.va
            )));
        }
        if let Some(other) = self
            .allocations
            .iter()
            .find(|o| alloc.va < o.end() && o.va < alloc.end())
        {
            return Err(Error::AddressConflict(format!(
                "[{:#x}, {:#x}) overlaps allocation {} ({}) at [{:#x}, {:#x})",
                alloc.va,
                alloc.end(),
                other.id,
                other.tag,
                other.va,
                other.end()
            )));
        }
        self.allocations.push(alloc);
        Ok(())
    }

    pub fn remove(&mut self, id: u64) -> Result<Allocation> {
        let at = self
            .allocations
            .iter()
            .position(|a| a.id == id)
            .ok_or(Error::UnknownAllocation(id))?;
        Ok(self.allocations.remove(at))
    }

    /// Bytes the metadata takes in an encoded layout (what a reader
    /// receives). O(entries): the daemon keeps a running count instead.
    pub fn metadata_encoded_bytes(&self) -> usize {
        self.metadata
            .iter()
            .map(|(k, v)| encoded_entry_len(k, v))
            .sum()
    }

    /// Adds or replaces one entry. Its size is counted as encoded (JSON
    /// escapes included), not as claimed: a value of control characters
    /// takes six bytes per byte on the wire, and the whole layout must reach
    /// a reader under its response limit. `encoded` is the running count of
    /// [`Layout::metadata_encoded_bytes`], kept by the caller.
    pub fn put_meta(
        &mut self,
        key: String,
        value: String,
        limits: &MetadataLimits,
        encoded: &mut usize,
    ) -> Result<()> {
        if key.is_empty() || key.len() > 1024 {
            return Err(Error::Invalid("metadata key must be 1-1024 bytes".into()));
        }
        let old = self
            .metadata
            .get(&key)
            .map_or(0, |v| encoded_entry_len(&key, v));
        let new_total = encoded.saturating_sub(old) + encoded_entry_len(&key, &value);
        if new_total > limits.max_bytes {
            return Err(Error::LimitExceeded(format!(
                "metadata would take {new_total} bytes encoded, limit is {}",
                limits.max_bytes
            )));
        }
        if old == 0 && self.metadata.len() >= limits.max_entries {
            return Err(Error::LimitExceeded(format!(
                "metadata already has {} entries, limit is {}",
                self.metadata.len(),
                limits.max_entries
            )));
        }
        self.metadata.insert(key, value);
        *encoded = new_total;
        Ok(())
    }
}

/// Bytes `s` takes as a JSON string, quotes and escapes included, exactly
/// as `serde_json` writes it: `"` and `\\` and the short control escapes
/// take two bytes, other control characters six (`\u00XX`), everything
/// else (UTF-8 included) itself.
pub fn json_string_len(s: &str) -> usize {
    2 + s
        .bytes()
        .map(|b| match b {
            b'"' | b'\\' | b'\n' | b'\r' | b'\t' | 0x08 | 0x0c => 2,
            0..=0x1f => 6,
            _ => 1,
        })
        .sum::<usize>()
}

/// Bytes one metadata entry adds to an encoded layout: `"key":"value",`.
pub fn encoded_entry_len(key: &str, value: &str) -> usize {
    json_string_len(key) + json_string_len(value) + 2
}

/// The most bytes one allocation can take in an encoded layout (largest
/// numbers, longest tag), so a daemon can bound a whole layout up front.
pub fn max_encoded_allocation_len() -> usize {
    let widest = Allocation {
        id: u64::MAX,
        tag: "x".repeat(64),
        size: u64::MAX,
        va: u64::MAX,
    };
    serde_json::to_vec(&widest).map_or(256, |v| v.len()) + 1
}

#[cfg(test)]
mod tests {
    use super::*;

    fn alloc(id: u64, va: u64, size: u64) -> Allocation {
        Allocation {
            id,
            tag: "weights".into(),
            size,
            va,
        }
    }

    #[test]
    fn overlapping_ranges_are_refused() {
        let mut l = Layout::default();
        l.insert(alloc(1, 0x10000, 0x1000)).unwrap();
        l.insert(alloc(2, 0x11000, 0x1000)).unwrap();
        assert!(l.insert(alloc(3, 0x10800, 0x1000)).is_err());
        assert!(l.insert(alloc(3, 0xf000, 0x2000)).is_err());
        assert!(l.insert(alloc(3, 0, 0x1000)).is_err());
        assert!(l.insert(alloc(3, u64::MAX - 10, 0x1000)).is_err());
        assert_eq!(l.bytes(), 0x2000);
        assert_eq!(l.remove(1).unwrap().id, 1);
        assert!(l.remove(1).is_err());
    }

    #[test]
    fn metadata_limits_hold() {
        let limits = MetadataLimits {
            max_entries: 2,
            max_bytes: 22,
        };
        let mut l = Layout::default();
        let mut n = 0;
        // "a":"1234", is 11 bytes encoded.
        l.put_meta("a".into(), "1234".into(), &limits, &mut n)
            .unwrap();
        assert_eq!(n, 11);
        l.put_meta("a".into(), "123".into(), &limits, &mut n)
            .unwrap(); // replace, same entry
        l.put_meta("b".into(), "1".into(), &limits, &mut n).unwrap();
        assert_eq!(n, l.metadata_encoded_bytes());
        assert!(l.put_meta("c".into(), "".into(), &limits, &mut n).is_err()); // entries
        assert!(l
            .put_meta("b".into(), "1234567".into(), &limits, &mut n)
            .is_err()); // bytes
        assert!(l
            .put_meta(String::new(), "x".into(), &limits, &mut n)
            .is_err());
        assert_eq!(n, l.metadata_encoded_bytes(), "refusals change nothing");
    }

    /// A value of control characters is six times its length on the wire:
    /// the limit counts that, not the claimed length.
    #[test]
    fn metadata_is_measured_as_encoded() {
        let limits = MetadataLimits {
            max_entries: 10,
            max_bytes: 100,
        };
        let mut l = Layout::default();
        let mut n = 0;
        let sneaky = "\u{1}".repeat(20);
        assert!(l.put_meta("k".into(), sneaky, &limits, &mut n).is_err());
        l.put_meta("k".into(), "x".repeat(20), &limits, &mut n)
            .unwrap();
        for s in [
            "",
            "plain",
            "quo\"te",
            "back\\slash",
            "\n\t\r\u{8}\u{c}",
            "\u{1}\u{1f}\u{7f}",
            "é漢🦀",
        ] {
            assert_eq!(
                json_string_len(s),
                serde_json::to_string(s).unwrap().len(),
                "{s:?}"
            );
        }
        assert!(max_encoded_allocation_len() < 200);
    }
}
