//! The pair's sd_notify socket: one `SOCK_DGRAM` Unix socket in the pair
//! directory, bound by the shim and seen by both engines. Identity never
//! comes from the message text: `SO_PASSCRED` makes the kernel attach the
//! sender's pid (translated into the shim's pid namespace), and the
//! supervisor maps that pid to a slot through its cgroup.
//!
//! Engines are untrusted, and this socket is read on the shim's one runtime
//! thread, so nothing a sender does may block or grow the shim. Two parts:
//!
//! - `socket.rs` reads the socket: what a datagram carries besides its
//!   text (fds, oversize, truncation, no credentials) is dropped there,
//!   whole, never half read, and fds never closed on the runtime thread;
//!   a datagram with `FDSTORE=1` keeps its fds, for the pair's fd store
//!   (`crate::pair::fdstore`), on a socket of a pair that has one;
//! - `gate.rs` decides which datagrams reach the supervisor (coalescing,
//!   a token bucket per engine, the bounded input queue) and counts and
//!   logs what is dropped.

mod gate;
mod socket;

pub use self::gate::{DropCounts, Gate, Queue, SenderSlot, QUEUE_MAX};
pub use self::socket::Dropped;
pub use self::socket::{
    close_off_runtime, discard, release_now, Close, Datagram, NotifySocket, Received,
};
