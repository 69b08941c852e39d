//! What `gmsd status` reports: state, leases, allocations and bytes, for
//! people (text) and tests (`--json`). The daemon fills it in under its lock,
//! so one report is one consistent snapshot.

use std::fmt::Write as _;

use serde::{Deserialize, Serialize};

use crate::types::{Allocation, LeaseKind};

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct LeaseInfo {
    pub id: u64,
    pub kind: LeaseKind,
    pub pid: i32,
    pub uid: u32,
    pub gid: u32,
    pub client: String,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct LayoutSummary {
    pub generation: u64,
    pub allocations: Vec<Allocation>,
    pub bytes: u64,
    pub metadata_entries: usize,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct LimitsReport {
    pub max_bytes: u64,
    pub max_allocations: usize,
    pub max_metadata_entries: usize,
    pub max_metadata_bytes: usize,
    pub max_connections: usize,
}

#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct StatusReport {
    pub pid: u32,
    pub backend: String,
    pub device: String,
    pub socket: String,
    /// `empty`, `loading`, `committed`, or `replacing` (a writer is loading
    /// a new layout while the previous one stays committed).
    pub state: String,
    pub connections: usize,
    pub leases: Vec<LeaseInfo>,
    /// The writer's uncommitted layout, if a writer holds the lease.
    pub working: Option<LayoutSummary>,
    pub committed: Option<LayoutSummary>,
    /// Bytes allocated (working + committed + the KV pool).
    pub bytes: u64,
    /// Bytes the kernel reports as backed by memory.
    pub resident_bytes: u64,
    pub allocations: usize,
    pub limits: LimitsReport,
    /// The pair's KV pool, once an engine was granted it.
    #[serde(default)]
    pub kv: Option<KvReport>,
}

/// The KV pool as the daemon holds it.
#[derive(Serialize, Deserialize, Clone, Debug, PartialEq)]
pub struct KvReport {
    pub pool: u64,
    pub size: u64,
    pub index_bytes: u64,
    pub va: u64,
    /// Write leases granted on it so far (one per promoted engine).
    pub grants: u64,
    /// The engine that holds, or last held, the write lease.
    pub writer_pid: Option<i32>,
    /// Whether that engine's connection is still open.
    pub writer_connected: bool,
    /// Earlier writers whose end the last grant's fence still waits for.
    pub fence_waits_for: usize,
}

impl StatusReport {
    pub fn render(&self) -> String {
        let mut out = String::new();
        let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
        let _ = writeln!(
            out,
            "gmsd pid {} backend {} device {} socket {}",
            self.pid, self.backend, self.device, self.socket
        );
        let _ = writeln!(
            out,
            "state {}; {} allocation(s), {:.1} MiB allocated, {:.1} MiB resident; {} connection(s)",
            self.state,
            self.allocations,
            mib(self.bytes),
            mib(self.resident_bytes),
            self.connections
        );
        let _ = writeln!(
            out,
            "limits: {:.1} MiB, {} allocations, {} metadata entries / {} bytes, {} connections",
            mib(self.limits.max_bytes),
            self.limits.max_allocations,
            self.limits.max_metadata_entries,
            self.limits.max_metadata_bytes,
            self.limits.max_connections
        );
        let _ = writeln!(out, "leases:");
        if self.leases.is_empty() {
            let _ = writeln!(out, "  (none)");
        }
        for l in &self.leases {
            let _ = writeln!(
                out,
                "  #{} {} pid {} uid {} gid {} {}",
                l.id, l.kind, l.pid, l.uid, l.gid, l.client
            );
        }
        if let Some(kv) = &self.kv {
            let _ = writeln!(
                out,
                "KV pool {:016x}: {:.1} MiB at {:#x}, index {} bytes; {} grant(s); writer pid {} ({}); fence waits for {}",
                kv.pool,
                mib(kv.size),
                kv.va,
                kv.index_bytes,
                kv.grants,
                kv.writer_pid.map_or("-".to_string(), |p| p.to_string()),
                if kv.writer_connected { "connected" } else { "gone" },
                kv.fence_waits_for
            );
        }
        for (name, layout) in [("working", &self.working), ("committed", &self.committed)] {
            let Some(layout) = layout else { continue };
            let _ = writeln!(
                out,
                "{name} layout (generation {}): {} allocation(s), {:.1} MiB, {} metadata entries",
                layout.generation,
                layout.allocations.len(),
                mib(layout.bytes),
                layout.metadata_entries
            );
            for a in &layout.allocations {
                let _ = writeln!(
                    out,
                    "  id {:<5} {:<12} {:>12} bytes at {:#x}",
                    a.id, a.tag, a.size, a.va
                );
            }
        }
        out
    }
}
