//! What a lease sees: allocations (id, tag, size, address) and key/value
//! metadata. A writer builds one; `commit` freezes it into the layout that
//! readers import. Pure data and its rules; the memory behind each
//! allocation lives in the daemon next to it.

use serde::{Deserialize, Serialize};

use crate::protocol::Metadata;
use crate::{Error, Result};

/// Highest user-space address on x86-64 (47-bit) and aarch64 (48-bit
/// configurations start lower, but the kernel refuses those anyway).
pub const MAX_USER_ADDRESS: u64 = 0x0000_7fff_ffff_f000;

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq, Eq)]
#[serde(deny_unknown_fields)]
pub struct Allocation {
    pub id: u64,
    /// What the memory is for: `weights`, `kv`, ...
    pub tag: String,
    /// Bytes, a multiple of the backend's granularity.
    pub size: u64,
    /// Where the writer mapped it; readers map it at the same address.
    pub va: u64,
}

impl Allocation {
    pub fn end(&self) -> u64 {
        self.va.saturating_add(self.size)
    }
}

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

    fn metadata_bytes(&self) -> usize {
        self.metadata.iter().map(|(k, v)| k.len() + v.len()).sum()
    }

    pub fn put_meta(&mut self, key: String, value: String, limits: &MetadataLimits) -> Result<()> {
        if key.is_empty() || key.len() > 1024 {
            return Err(Error::Invalid("metadata key must be 1-1024 bytes".into()));
        }
        let old = self.metadata.get(&key).map_or(0, |v| key.len() + v.len());
        let new_total = self.metadata_bytes() - old + key.len() + value.len();
        if new_total > limits.max_bytes {
            return Err(Error::LimitExceeded(format!(
                "metadata would total {new_total} bytes, limit is {}",
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
        Ok(())
    }
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
            max_bytes: 10,
        };
        let mut l = Layout::default();
        l.put_meta("a".into(), "1234".into(), &limits).unwrap();
        l.put_meta("a".into(), "123".into(), &limits).unwrap(); // replace, same entry
        l.put_meta("b".into(), "1".into(), &limits).unwrap();
        assert!(l.put_meta("c".into(), "".into(), &limits).is_err()); // entries
        assert!(l.put_meta("b".into(), "1234567".into(), &limits).is_err()); // bytes
        assert!(l.put_meta(String::new(), "x".into(), &limits).is_err());
    }
}
