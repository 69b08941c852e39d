//! What every container of one shim shares, whatever its kind: the config,
//! the containerd namespace, the exit router and the event sink. The
//! service hands it to each Create; plain containers and pairs take their
//! parts from it.

use std::sync::Arc;

use crate::config::Config;
use crate::events::EventSink;
use crate::exits::ExitRouter;

/// What every container of this shim shares.
pub struct Runtime {
    pub config: Config,
    /// containerd's address (`-address`): pairs' host files are keyed by it.
    pub containerd: String,
    pub namespace: String,
    pub router: Arc<ExitRouter>,
    pub events: EventSink,
}
