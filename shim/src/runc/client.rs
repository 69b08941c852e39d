//! [`RuncClient`], the only type that runs runc: plain containers, the
//! pair's engines and the `delete` action call its methods, one per runc
//! command, and nothing else touches the `runc` crate's client. Here are
//! the command lines and their options, the stdio handed to runc, and the
//! pid files runc writes; how runc is spawned (`spawner`), how
//! `--preserve-fds` is added (`preserve`) and what a failure means
//! (`failure`) are their own files below this one.

use std::os::fd::BorrowedFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use oci_spec::runtime::{LinuxResources, Process as ProcessSpec};
use runc::options::{CreateOpts, DeleteOpts, ExecOpts, GlobalOpts, KillOpts};
use runc::Runc;

use super::failure::{self, finished_is_not_found};
use super::preserve::PreservedFds;
use super::spawner::ReapedSpawner;
use crate::config::Config;
use crate::error::{Error, Result, RuncFailure};
use crate::exits::ExitRouter;
use crate::options::RuncOptions;

/// The pid file of a container's init (or an engine), in its bundle.
pub const INIT_PID_FILE: &str = "init.pid";

/// How the process runc starts gets its stdio.
pub enum RuncStdio<'a> {
    /// runc hands the pty master to this console socket.
    Console(&'a Path),
    /// runc's own command gets these (pipes, or a pair's shared output);
    /// they are closed in the shim once runc returns.
    Fds(Arc<dyn runc::io::Io>),
}

/// runc, configured for one bundle: its binary, its state root for the
/// namespace, and a JSON log in the bundle. Every runc command the shim
/// runs is a method here.
#[derive(Clone, Debug)]
pub struct RuncClient {
    runc: Runc,
    /// runc's state root for the namespace: `<root>/<id>` exists while runc
    /// knows the container.
    root: PathBuf,
    log: PathBuf,
    /// `--no-pivot` and `--no-new-keyring` for create and run.
    no_pivot: bool,
    no_new_keyring: bool,
    /// `IoUid`/`IoGid`: owner of the stdio pipes handed to the processes.
    io_owner: Option<(u32, u32)>,
}

impl RuncClient {
    /// The task's runc options (`options`) override the config's binary
    /// and root, as runc-v2's do: `<root>/<namespace>` is the state root.
    pub fn new(
        config: &Config,
        namespace: &str,
        bundle: &Path,
        router: Arc<ExitRouter>,
        options: &RuncOptions,
    ) -> Result<Self> {
        let log = bundle.join("log.json");
        let root = match &options.root {
            Some(root) => root.join(namespace),
            None => config.runc_root(namespace),
        };
        let (binary, source) = match &options.binary {
            Some(b) => (b.as_str(), "the task's runtime options, BinaryName"),
            None => (config.runc.binary.as_str(), "config runc.binary"),
        };
        let mut opts = GlobalOpts::new()
            .command(binary)
            .root(&root)
            .log(&log)
            .log_json()
            .systemd_cgroup(options.systemd_cgroup);
        opts.custom_spawner(Arc::new(ReapedSpawner::new(router)));
        let runc = opts.build().map_err(|e| {
            Error::FailedPrecondition(format!("runc binary {binary:?} ({source}): {e}"))
        })?;
        Ok(RuncClient {
            runc,
            root,
            log,
            no_pivot: options.no_pivot_root,
            no_new_keyring: options.no_new_keyring,
            io_owner: Some((options.io_uid, options.io_gid)).filter(|o| *o != (0, 0)),
        })
    }

    /// Who must own the container's ends of its stdio pipes (`IoUid`,
    /// `IoGid`), when the options name someone other than root.
    pub fn io_owner(&self) -> Option<(u32, u32)> {
        self.io_owner
    }

    fn create_opts(&self, pid_file: &Path) -> CreateOpts {
        CreateOpts::new()
            .pid_file(pid_file)
            .no_pivot(self.no_pivot)
            .no_new_keyring(self.no_new_keyring)
    }

    /// `runc create` of `bundle`; returns the init's pid.
    pub async fn create(&self, id: &str, bundle: &Path, stdio: RuncStdio<'_>) -> Result<u32> {
        let pid_file = bundle.join(INIT_PID_FILE);
        let opts = with_stdio(self.create_opts(&pid_file), stdio);
        let created = self.runc.create(id, bundle, Some(&opts)).await;
        drop(opts); // closes the container's stdio ends in the shim
        created.map_err(|e| self.error("create", id, e))?;
        read_pid(&pid_file)
    }

    /// `runc run --detach` of `bundle` (an engine: created and started in
    /// one step); returns its pid. `inherit` become the process's
    /// descriptors 3, 4, … (`runc run --preserve-fds`).
    pub async fn run_detached(
        &self,
        id: &str,
        bundle: &Path,
        stdio: RuncStdio<'_>,
        inherit: &[BorrowedFd<'_>],
    ) -> Result<u32> {
        self.create_or_run(true, id, bundle, stdio, inherit).await
    }

    /// `runc create` of `bundle` whose process will inherit `inherit` as
    /// its descriptors 3, 4, … (`runc create --preserve-fds`); returns the
    /// init's pid. `start` runs it.
    pub async fn create_inheriting(
        &self,
        id: &str,
        bundle: &Path,
        stdio: RuncStdio<'_>,
        inherit: &[BorrowedFd<'_>],
    ) -> Result<u32> {
        self.create_or_run(false, id, bundle, stdio, inherit).await
    }

    async fn create_or_run(
        &self,
        run: bool,
        id: &str,
        bundle: &Path,
        stdio: RuncStdio<'_>,
        inherit: &[BorrowedFd<'_>],
    ) -> Result<u32> {
        let pid_file = bundle.join(INIT_PID_FILE);
        // A previous generation's pid must never be read as this one's.
        let _ = std::fs::remove_file(&pid_file);
        let stdio = match stdio {
            RuncStdio::Fds(io) if !inherit.is_empty() => {
                let fds = inherit
                    .iter()
                    .map(|fd| fd.try_clone_to_owned())
                    .collect::<std::io::Result<Vec<_>>>()
                    .map_err(|e| Error::io(format!("duplicating the sockets {id} inherits"), e))?;
                RuncStdio::Fds(Arc::new(PreservedFds::new(io, fds)))
            }
            RuncStdio::Console(_) if !inherit.is_empty() => {
                return Err(Error::InvalidArgument(format!(
                    "{id}: inherited sockets with a terminal are not supported"
                )))
            }
            stdio => stdio,
        };
        let (done, step) = if run {
            let opts = with_stdio(self.create_opts(&pid_file).detach(true), stdio);
            let ran = self.runc.run(id, bundle, Some(&opts)).await;
            drop(opts);
            (ran.map(|_| ()), "run")
        } else {
            let opts = with_stdio(self.create_opts(&pid_file), stdio);
            let created = self.runc.create(id, bundle, Some(&opts)).await;
            drop(opts);
            (created.map(|_| ()), "create")
        };
        done.map_err(|e| self.error(step, id, e))?;
        read_pid(&pid_file)
    }

    /// `runc start`: the created init runs the spec's process.
    pub async fn start(&self, id: &str) -> Result<()> {
        self.runc
            .start(id)
            .await
            .map_err(|e| self.error("start", id, e))
    }

    /// `runc exec --detach` of `spec` as `exec_id`; returns its pid. The
    /// pid file lives in `bundle` for as long as the call.
    pub async fn exec(
        &self,
        id: &str,
        bundle: &Path,
        exec_id: &str,
        spec: &ProcessSpec,
        stdio: RuncStdio<'_>,
    ) -> Result<u32> {
        let pid_file = bundle.join(format!("exec-{exec_id}.pid"));
        let spec: oci_spec_runc::runtime::Process = retype(spec)?;
        let opts = match stdio {
            RuncStdio::Console(path) => ExecOpts::new().console_socket(path),
            RuncStdio::Fds(io) => ExecOpts::new().io(io),
        }
        .pid_file(&pid_file)
        .detach(true);
        let ran = self.runc.exec(id, &spec, Some(&opts)).await;
        drop(opts);
        ran.map_err(|e| self.error("exec", id, e))?;
        let pid = read_pid(&pid_file);
        let _ = std::fs::remove_file(&pid_file);
        pid
    }

    /// `runc kill [--all] <signal>`.
    pub async fn kill(&self, id: &str, signal: u32, all: bool) -> Result<()> {
        let opts = KillOpts::new().all(all);
        self.runc
            .kill(id, signal, Some(&opts))
            .await
            .map_err(|e| finished_is_not_found(self.error("kill", id, e)))
    }

    /// `runc delete --force`: kills what still runs and removes runc's
    /// state. A container runc does not know is already deleted, and costs
    /// no runc run: runc keeps `<root>/<id>` from its create to its delete,
    /// so where there is none, nothing is asked (the `delete` action looks
    /// for a pair's engines after every container, plain ones too).
    pub async fn delete_force(&self, id: &str) -> Result<()> {
        if !self.knows(id) {
            return Ok(());
        }
        let force = DeleteOpts::new().force(true);
        match self.runc.delete(id, Some(&force)).await {
            Ok(()) => Ok(()),
            Err(e) => match self.error("delete", id, e) {
                Error::Runc {
                    kind: RuncFailure::NotFound,
                    ..
                } => Ok(()),
                e => Err(e),
            },
        }
    }

    /// `runc pause`.
    pub async fn pause(&self, id: &str) -> Result<()> {
        self.runc
            .pause(id)
            .await
            .map_err(|e| self.error("pause", id, e))
    }

    /// `runc resume`.
    pub async fn resume(&self, id: &str) -> Result<()> {
        self.runc
            .resume(id)
            .await
            .map_err(|e| self.error("resume", id, e))
    }

    /// `runc ps`: the pids of the container's processes.
    pub async fn ps(&self, id: &str) -> Result<Vec<u32>> {
        let pids = self
            .runc
            .ps(id)
            .await
            .map_err(|e| self.error("ps", id, e))?;
        Ok(pids.into_iter().map(|p| p as u32).collect())
    }

    /// `runc update` with new resource limits.
    pub async fn update(&self, id: &str, resources: &LinuxResources) -> Result<()> {
        self.runc
            .update(id, &retype(resources)?)
            .await
            .map_err(|e| self.error("update", id, e))
    }

    /// Whether runc keeps state for `id` (its directory under the root).
    fn knows(&self, id: &str) -> bool {
        self.root.join(id).is_dir()
    }

    /// Turn a runc crate error into ours (see [`failure::error`]): runc's
    /// log is this client's, and its state root says whether runc still
    /// knows `id`.
    fn error(&self, op: &'static str, id: &str, e: runc::error::Error) -> Error {
        failure::error(op, id, e, &self.log, || self.knows(id))
    }
}

fn with_stdio(opts: CreateOpts, stdio: RuncStdio<'_>) -> CreateOpts {
    match stdio {
        RuncStdio::Console(path) => opts.console_socket(path),
        RuncStdio::Fds(io) => opts.io(io),
    }
}

/// The pid runc wrote. The file is runc's, not the caller's: a bad one is
/// an internal error.
fn read_pid(path: &Path) -> Result<u32> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| Error::io(format!("reading runc pid file {}", path.display()), e))?;
    text.trim().parse().map_err(|_| Error::Internal {
        what: format!("runc pid file {}", path.display()),
        reason: format!("{text:?} is not a pid"),
    })
}

/// Re-type a spec value for the runc crate, which uses an older oci-spec.
fn retype<A: serde::Serialize, B: serde::de::DeserializeOwned>(value: &A) -> Result<B> {
    serde_json::to_value(value)
        .and_then(serde_json::from_value)
        .map_err(|e| Error::InvalidArgument(format!("spec not accepted by runc client: {e}")))
}

#[cfg(test)]
mod tests {
    use std::os::unix::process::ExitStatusExt;
    use std::process::ExitStatus;

    use super::*;

    fn client_with(binary: &str, root: &Path, bundle: &Path) -> RuncClient {
        let mut config = Config::default();
        config.runc.binary = binary.into();
        config.runc.root = root.to_path_buf();
        RuncClient::new(
            &config,
            "ns",
            bundle,
            Arc::new(ExitRouter::default()),
            &RuncOptions::default(),
        )
        .unwrap()
    }

    #[tokio::test]
    async fn deleting_a_container_runc_does_not_know_runs_no_runc() {
        use std::os::unix::fs::PermissionsExt;
        // A runc that would leave a trace; it must not run at all (and so
        // no child is spawned here that another test's reaper could take).
        let d = tempfile::tempdir().unwrap();
        let calls = d.path().join("calls");
        let runc = d.path().join("runc");
        std::fs::write(&runc, format!("#!/bin/sh\ntouch {}\n", calls.display())).unwrap();
        std::fs::set_permissions(&runc, std::fs::Permissions::from_mode(0o755)).unwrap();
        let client = client_with(&runc.display().to_string(), d.path(), d.path());
        client.delete_force("c1-s0").await.unwrap();
        assert!(
            !calls.exists(),
            "runc was run for a container it has no state for"
        );
        // runc's state dir is what says it knows one.
        std::fs::create_dir_all(d.path().join("ns/c1")).unwrap();
        assert!(client.knows("c1") && !client.knows("c1-s0"));
    }

    fn command_failed(stderr: &str) -> runc::error::Error {
        runc::error::Error::CommandFailed {
            status: ExitStatus::from_raw(1 << 8),
            stdout: String::new(),
            stderr: stderr.into(),
        }
    }

    #[test]
    fn absent_state_dir_means_not_found_except_for_commands_that_make_it() {
        let d = tempfile::tempdir().unwrap();
        let client = client_with("/bin/true", d.path(), d.path());
        let e = client.error("kill", "c1", command_failed("some other wording"));
        assert!(
            matches!(
                e,
                Error::Runc {
                    kind: RuncFailure::NotFound,
                    ..
                }
            ),
            "{e:?}"
        );
        assert_eq!(e.code(), containerd_shim_protos::ttrpc::Code::NOT_FOUND);
        // create/run fail before runc keeps state: the message decides.
        let e = client.error("create", "c1", command_failed("some other wording"));
        assert!(
            matches!(
                e,
                Error::Runc {
                    kind: RuncFailure::Other,
                    ..
                }
            ),
            "{e:?}"
        );
        // While runc knows the container, its message decides.
        std::fs::create_dir_all(d.path().join("ns/c1")).unwrap();
        let e = client.error("kill", "c1", command_failed("container not running"));
        assert!(
            matches!(
                e,
                Error::Runc {
                    kind: RuncFailure::WrongState,
                    ..
                }
            ),
            "{e:?}"
        );
        // …and a kill that finds the init dead, not yet reaped, is NotFound,
        // as runc-v2 answers it; a paused container stays a wrong state.
        let e = finished_is_not_found(e);
        assert_eq!(
            e.code(),
            containerd_shim_protos::ttrpc::Code::NOT_FOUND,
            "{e:?}"
        );
        assert!(e.to_string().contains("already finished"), "{e}");
        let e =
            finished_is_not_found(client.error("kill", "c1", command_failed("container paused")));
        assert_eq!(
            e.code(),
            containerd_shim_protos::ttrpc::Code::FAILED_PRECONDITION,
            "{e:?}"
        );
    }

    #[test]
    fn missing_runc_binary_names_the_config_key() {
        let d = tempfile::tempdir().unwrap();
        let mut config = Config::default();
        config.runc.binary = "/nonexistent/runc".into();
        let router = Arc::new(ExitRouter::default());
        let e = RuncClient::new(
            &config,
            "ns",
            d.path(),
            router.clone(),
            &RuncOptions::default(),
        )
        .unwrap_err();
        assert_eq!(
            e.code(),
            containerd_shim_protos::ttrpc::Code::FAILED_PRECONDITION
        );
        let msg = e.to_string();
        assert!(
            msg.contains("/nonexistent/runc") && msg.contains("runc.binary"),
            "{msg}"
        );
        // The task's options name their own binary: the error says so.
        config.runc.binary = "runc".into();
        let options = RuncOptions {
            binary: Some("/nonexistent/no-runc".into()),
            ..Default::default()
        };
        let e = RuncClient::new(&config, "ns", d.path(), router, &options).unwrap_err();
        let msg = e.to_string();
        assert!(
            msg.contains("/nonexistent/no-runc") && msg.contains("BinaryName"),
            "{msg}"
        );
    }

    #[test]
    fn the_tasks_runc_root_replaces_the_configs() {
        let d = tempfile::tempdir().unwrap();
        let mut config = Config::default();
        config.runc.binary = "/bin/true".into();
        config.runc.root = d.path().join("config-root");
        let options = RuncOptions {
            root: Some(d.path().join("task-root")),
            ..Default::default()
        };
        let client = RuncClient::new(
            &config,
            "ns",
            d.path(),
            Arc::new(ExitRouter::default()),
            &options,
        )
        .unwrap();
        assert_eq!(client.root, d.path().join("task-root/ns"));
        std::fs::create_dir_all(d.path().join("config-root/ns/c1")).unwrap();
        assert!(!client.knows("c1"));
        std::fs::create_dir_all(d.path().join("task-root/ns/c1")).unwrap();
        assert!(client.knows("c1"));
    }

    #[test]
    fn bad_pid_file_is_internal() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join(INIT_PID_FILE);
        std::fs::write(&p, "12\n").unwrap();
        assert_eq!(read_pid(&p).unwrap(), 12);
        std::fs::write(&p, "garbage").unwrap();
        let e = read_pid(&p).unwrap_err();
        assert_eq!(e.code(), containerd_shim_protos::ttrpc::Code::INTERNAL);
        assert!(e.to_string().contains(&p.display().to_string()), "{e}");
    }
}
