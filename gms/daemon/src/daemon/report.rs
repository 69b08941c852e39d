//! The status report (`gmsd status`, `status` on the wire): state, leases,
//! both layouts, bytes allocated and resident, and the limits. Built from
//! the daemon's state under its lock, so one report is one consistent
//! snapshot. Kept apart because it reads everything and changes nothing.

use gms::status::{LayoutSummary, LeaseInfo, LimitsReport, StatusReport};

use super::{Daemon, State, Store};

impl Daemon {
    pub(super) fn report(&self, st: &State) -> StatusReport {
        let summary = |s: &Store| LayoutSummary {
            generation: s.layout.generation,
            allocations: s.layout.allocations.clone(),
            bytes: s.layout.bytes(),
            metadata_entries: s.layout.metadata.len(),
        };
        let stores = || [&st.working, &st.committed].into_iter().flatten();
        let resident_bytes: u64 = stores()
            .flat_map(|s| s.memory.values())
            .map(|m| m.resident_bytes().unwrap_or(0))
            .sum();
        let state = match (st.working.is_some(), st.committed.is_some()) {
            (false, false) => "empty",
            (true, false) => "loading",
            (false, true) => "committed",
            (true, true) => "replacing",
        };
        let l = &self.config.limits;
        let (kv_bytes, kv_resident) = st.kv_bytes();
        StatusReport {
            pid: std::process::id(),
            backend: self.backend.name().into(),
            device: self.backend.device(),
            socket: self.socket.display().to_string(),
            state: state.into(),
            connections: st.connections.len(),
            leases: st
                .connections
                .values()
                .filter_map(|c| {
                    let id = c.lease?;
                    Some(LeaseInfo {
                        id,
                        kind: st.leases.kind(id)?,
                        pid: c.pid,
                        uid: c.uid,
                        gid: c.gid,
                        client: c.client.clone(),
                    })
                })
                .collect(),
            working: st.working.as_ref().map(summary),
            committed: st.committed.as_ref().map(summary),
            bytes: stores().map(|s| s.layout.bytes()).sum::<u64>() + kv_bytes,
            resident_bytes: resident_bytes + kv_resident,
            allocations: stores().map(|s| s.layout.allocations.len()).sum(),
            limits: LimitsReport {
                max_bytes: l.max_bytes,
                max_allocations: l.max_allocations,
                max_metadata_entries: l.max_metadata_entries,
                max_metadata_bytes: l.max_metadata_bytes,
                max_connections: l.max_connections,
            },
            kv: st.kv_report(),
        }
    }
}
