//! The paths other crates of the workspace name (the shim, the tests, the
//! example engine, `gmsd`, `gms-cuda`, `libgms`) stay where they are when
//! the crate's modules move: this file only has to compile, and says which
//! re-export serves which path.

#![allow(unused_imports)]

use gms::client::{
    cuda_socket_name, host_socket, reset, status, status_within, Client, Imported, KvCache, Weights,
};
use gms::layout::{self, Allocation, Layout, MetadataLimits};
use gms::mapper::{Mapper, Range, RangeState};
use gms::protocol::{self, ErrorCode, LeaseKind, Metadata, Mode, Request, Response};
use gms::status::{LayoutSummary, LeaseInfo, LimitsReport, StatusReport};
use gms::{wire, Access, Error, Result};

/// The shared words are one type under each of their names.
#[test]
fn old_and_new_paths_name_the_same_types() {
    let kind: gms::types::LeaseKind = LeaseKind::Rw;
    let mode: gms::types::Mode = Mode::RwOrRo;
    let code: gms::types::ErrorCode = ErrorCode::Timeout;
    let alloc: gms::types::Allocation = Allocation {
        id: 1,
        tag: "weights".into(),
        size: 4096,
        va: 0x10000,
    };
    let meta: gms::types::Metadata = Metadata::new();
    let err = Error::Remote {
        code,
        message: String::new(),
    };
    assert_eq!(err.code(), ErrorCode::Timeout);
    assert_eq!(
        (kind, mode, alloc.end(), meta.len()),
        (LeaseKind::Rw, Mode::RwOrRo, 0x11000, 0)
    );
}
