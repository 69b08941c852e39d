//! The `containerd_shim::asynchronous::Shim` glue for every action except
//! `start` (which `start.rs` owns): building the Task service for the
//! serving daemon, the `delete` action containerd runs after a shim died
//! (which also removes what a dead pair left: `pair::leftovers`), and
//! waiting for the exit signal that Shutdown raises.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::SystemTime;

use async_trait::async_trait;
use containerd_shim::asynchronous::{publisher::RemotePublisher, ExitSignal, Shim};
use containerd_shim::{Config as ShimConfig, DeleteResponse, Flags, StartOpts};

use crate::bundle::BUNDLE_CONFIG;
use crate::config::{Config, ConfigSource, Origin, ENV_CONFIG_ORIGIN};
use crate::events::{spawn_forwarder, ContainerdEvents, EventSink};
use crate::exits::ExitRouter;
use crate::options::RuncOptions;
use crate::runc::RuncClient;
use crate::runtime::Runtime;
use crate::service::TaskService;
use crate::time::timestamp;

/// How long the exiting shim waits for its last events to reach containerd.
const FLUSH_AT_EXIT: std::time::Duration = std::time::Duration::from_secs(5);

pub struct ShadowShim {
    namespace: String,
    id: String,
    bundle: PathBuf,
    config: Config,
    /// Where the config came from, logged once the logger is up.
    origin: Origin,
    /// `-socket`: the ttrpc socket this daemon serves.
    socket: String,
    /// `-address`: containerd's socket, part of the group's socket name.
    address: String,
    exit: Arc<ExitSignal>,
    /// The task service's event sink, for the last flush before exit.
    events: std::sync::OnceLock<EventSink>,
}

/// The config for this process: the source `start` handed down, else the
/// copy in the bundle (with the origin `start` found for it), else the
/// default file.
pub fn load_config(bundle: &Path) -> crate::error::Result<(Config, Origin)> {
    let source = ConfigSource::from_env();
    if source == ConfigSource::default() {
        let saved = bundle.join(BUNDLE_CONFIG);
        if saved.exists() {
            let (config, copy) = ConfigSource {
                body: None,
                path: Some(saved),
            }
            .load_with_origin()?;
            let origin = std::env::var(ENV_CONFIG_ORIGIN)
                .ok()
                .and_then(|o| Origin::from_env(&o))
                .unwrap_or(copy);
            return Ok((config, origin));
        }
    }
    source.load_with_origin()
}

/// After a shim died (the reason containerd runs `delete`), its socket file
/// is left behind. Remove it, but only if nothing answers on it: a pod's
/// other containers may still be served there.
fn remove_stale_socket(address: &str, namespace: &str, bundle: &Path, id: &str) {
    let group = crate::bundle::grouping(bundle, id);
    let socket = containerd_shim::socket_address(address, namespace, &group);
    let path = socket.strip_prefix("unix://").unwrap_or(&socket);
    if let Err(e) = std::os::unix::net::UnixStream::connect(path) {
        if e.kind() == std::io::ErrorKind::ConnectionRefused {
            if let Err(e) = std::fs::remove_file(path) {
                log::warn!("removing stale socket {path}: {e}");
            }
        }
    }
}

#[async_trait]
impl Shim for ShadowShim {
    type T = TaskService;

    async fn new(_runtime_id: &str, args: &Flags, shim_config: &mut ShimConfig) -> Self {
        let bundle = if args.bundle.is_empty() {
            std::env::current_dir().unwrap_or_else(|_| PathBuf::from("."))
        } else {
            PathBuf::from(&args.bundle)
        };
        let (config, origin) = match load_config(&bundle) {
            Ok(c) => c,
            Err(e) => {
                eprintln!("containerd-shim-shadow-v1: {e}");
                std::process::exit(1);
            }
        };
        shim_config.default_log_level = config.log_level.clone();
        ShadowShim {
            namespace: args.namespace.clone(),
            id: args.id.clone(),
            bundle,
            config,
            origin,
            socket: args.socket.clone(),
            address: args.address.clone(),
            exit: Arc::new(ExitSignal::default()),
            events: std::sync::OnceLock::new(),
        }
    }

    async fn start_shim(&mut self, _opts: StartOpts) -> containerd_shim::Result<String> {
        // main.rs runs our own start path; reaching this is a programming error.
        Err(containerd_shim::Error::Unimplemented(
            "start is handled by the shadow shim's own start path".into(),
        ))
    }

    async fn delete_shim(&mut self) -> containerd_shim::Result<DeleteResponse> {
        let router = ExitRouter::start()
            .await
            .map_err(|e| containerd_shim::Error::Other(e.to_string()))?;
        // The runc root and binary the task was created with.
        let options = RuncOptions::load(&self.bundle).unwrap_or_else(|e| {
            log::warn!("delete {}: {e}; using the config's runc", self.id);
            RuncOptions::default()
        });
        let client = RuncClient::new(
            &self.config,
            &self.namespace,
            &self.bundle,
            router.clone(),
            &options,
        )
        .map_err(|e| containerd_shim::Error::Other(e.to_string()))?;
        if let Err(e) = client.delete_force(&self.id).await {
            log::warn!("delete {}: {e}", self.id);
        }
        // A pair's engines, gmsd and host files (nothing for a plain
        // container but two runc look-ups).
        let pair = crate::pair::leftovers::PairName {
            config: &self.config,
            containerd: &self.address,
            namespace: &self.namespace,
            id: &self.id,
        };
        crate::pair::leftovers::remove(&pair, &self.bundle, router, &options).await;
        remove_stale_socket(&self.address, &self.namespace, &self.bundle, &self.id);
        let rootfs = self.bundle.join("rootfs").display().to_string();
        if let Err(e) = containerd_shim::mount::umount_recursive(Some(&rootfs), libc::MNT_DETACH) {
            log::warn!("delete {}: unmounting {rootfs}: {e}", self.id);
        }
        Ok(DeleteResponse {
            pid: 0,
            exit_status: 128 + libc::SIGKILL as u32,
            exited_at: Some(timestamp(SystemTime::now())).into(),
            ..Default::default()
        })
    }

    async fn wait(&mut self) {
        // The server is up: startup code is not needed again.
        crate::memory::trim_when_idle();
        self.exit.wait().await;
        // containerd shuts a shim down right after its last Delete: the
        // delete event (and whatever waits before it) goes out first.
        if let Some(events) = self.events.get() {
            if !events.flushed(FLUSH_AT_EXIT).await {
                log::warn!(
                    "exiting with events containerd has not taken after {} s",
                    FLUSH_AT_EXIT.as_secs()
                );
            }
        }
        // containerd-shim removes the socket through the bundle's `address`
        // file, which containerd may already have deleted with the bundle:
        // remove it here, by the path we were given.
        let path = self
            .socket
            .strip_prefix("unix://")
            .unwrap_or(&self.socket)
            .to_string();
        if !path.is_empty() {
            if let Err(e) = std::fs::remove_file(&path) {
                if e.kind() != std::io::ErrorKind::NotFound {
                    log::warn!("removing socket {path}: {e}");
                }
            }
        }
    }

    async fn create_task_service(&self, publisher: RemotePublisher) -> TaskService {
        let router = match ExitRouter::start().await {
            Ok(r) => r,
            Err(e) => {
                log::error!("cannot subscribe to child exits: {e}");
                std::process::exit(1);
            }
        };
        self.origin.log();
        // The crate's publisher is used for its address only: its queue
        // reorders events that fail (see `events::ContainerdEvents`).
        let (events, queue) = EventSink::channel();
        spawn_forwarder(
            ContainerdEvents::new(&publisher.address),
            self.namespace.clone(),
            queue,
        );
        let _ = self.events.set(events.clone());
        TaskService::new(
            Runtime {
                config: self.config.clone(),
                containerd: self.address.clone(),
                namespace: self.namespace.clone(),
                router,
                events,
            },
            self.exit.clone(),
        )
    }
}
