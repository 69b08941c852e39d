//! A Kubernetes CRI v1 client for tests: it speaks gRPC to containerd's CRI
//! plugin over the private containerd's socket, the way the kubelet does,
//! so the shim is tested under the exact calls a node makes (RunPodSandbox
//! with a runtime handler, CreateContainer, StartContainer, ContainerStatus,
//! Stop/Remove). Calls block (tests are synchronous) and each has a deadline.

use crate::{Error, Result};
use hyper_util::rt::TokioIo;
use k8s_cri::v1::image_service_client::ImageServiceClient;
use k8s_cri::v1::runtime_service_client::RuntimeServiceClient;
use k8s_cri::v1::*;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::time::Duration;
use tonic::transport::{Channel, Endpoint, Uri};

pub use k8s_cri::v1;

/// How long one CRI call may take before the test gives up on it.
const CALL_TIMEOUT: Duration = Duration::from_secs(60);

/// A connected CRI client (runtime and image services on one channel).
pub struct Cri {
    rt: tokio::runtime::Runtime,
    runtime: RuntimeServiceClient<Channel>,
    images: ImageServiceClient<Channel>,
    address: PathBuf,
}

impl Cri {
    /// Connect to the CRI plugin on containerd's gRPC socket.
    pub fn connect(address: &Path) -> Result<Self> {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| Error::io("start tokio runtime", address, e))?;
        let path = address.to_owned();
        let channel = rt
            .block_on(async {
                // The URI is a placeholder: the connector dials the socket.
                Endpoint::from_static("http://[::]:50051")
                    .connect_with_connector(tower::service_fn(move |_: Uri| {
                        let path = path.clone();
                        async move {
                            let s = tokio::net::UnixStream::connect(path).await?;
                            Ok::<_, std::io::Error>(TokioIo::new(s))
                        }
                    }))
                    .await
            })
            .map_err(|e| Error::Cri {
                call: "connect",
                address: address.to_owned(),
                reason: e.to_string(),
            })?;
        Ok(Cri {
            rt,
            runtime: RuntimeServiceClient::new(channel.clone()),
            images: ImageServiceClient::new(channel),
            address: address.to_owned(),
        })
    }

    fn call<T>(
        &self,
        call: &'static str,
        fut: impl Future<Output = std::result::Result<tonic::Response<T>, tonic::Status>>,
    ) -> Result<T> {
        let err = |reason: String| Error::Cri {
            call,
            address: self.address.clone(),
            reason,
        };
        // The timer must be made inside the runtime, so wrap it in the async block.
        match self
            .rt
            .block_on(async { tokio::time::timeout(CALL_TIMEOUT, fut).await })
        {
            Ok(Ok(r)) => Ok(r.into_inner()),
            Ok(Err(status)) => Err(err(format!("{:?}: {}", status.code(), status.message()))),
            Err(_) => Err(err(format!("no answer within {CALL_TIMEOUT:?}"))),
        }
    }

    /// `Version`: the runtime's name and version (proves the plugin serves).
    pub fn version(&self) -> Result<VersionResponse> {
        let mut c = self.runtime.clone();
        self.call("Version", c.version(VersionRequest::default()))
    }

    /// `ImageStatus` of `image`: `None` when the plugin does not know it.
    pub fn image(&self, image: &str) -> Result<Option<Image>> {
        let mut c = self.images.clone();
        let req = ImageStatusRequest {
            image: Some(ImageSpec {
                image: image.to_owned(),
                ..Default::default()
            }),
            verbose: false,
        };
        Ok(self.call("ImageStatus", c.image_status(req))?.image)
    }

    /// `RunPodSandbox` with `handler` (the RuntimeClass's handler); the pod id.
    pub fn run_pod(&self, config: &PodSandboxConfig, handler: &str) -> Result<String> {
        let mut c = self.runtime.clone();
        let req = RunPodSandboxRequest {
            config: Some(config.clone()),
            runtime_handler: handler.to_owned(),
        };
        Ok(self
            .call("RunPodSandbox", c.run_pod_sandbox(req))?
            .pod_sandbox_id)
    }

    /// `CreateContainer` in `pod`; the container id.
    pub fn create_container(
        &self,
        pod: &str,
        config: &ContainerConfig,
        pod_config: &PodSandboxConfig,
    ) -> Result<String> {
        let mut c = self.runtime.clone();
        let req = CreateContainerRequest {
            pod_sandbox_id: pod.to_owned(),
            config: Some(config.clone()),
            sandbox_config: Some(pod_config.clone()),
        };
        Ok(self
            .call("CreateContainer", c.create_container(req))?
            .container_id)
    }

    /// `StartContainer`.
    pub fn start_container(&self, id: &str) -> Result<()> {
        let mut c = self.runtime.clone();
        let req = StartContainerRequest {
            container_id: id.to_owned(),
        };
        self.call("StartContainer", c.start_container(req))
            .map(drop)
    }

    /// `ContainerStatus` (verbose: `info["info"]` carries containerd's view, pid included).
    pub fn container_status(&self, id: &str) -> Result<ContainerStatusResponse> {
        let mut c = self.runtime.clone();
        let req = ContainerStatusRequest {
            container_id: id.to_owned(),
            verbose: true,
        };
        self.call("ContainerStatus", c.container_status(req))
    }

    /// The container's state alone.
    pub fn container_state(&self, id: &str) -> Result<ContainerState> {
        let st = self.container_status(id)?;
        let raw = st.status.map(|s| s.state).unwrap_or(-1);
        ContainerState::try_from(raw).map_err(|_| Error::Cri {
            call: "ContainerStatus",
            address: self.address.clone(),
            reason: format!("container {id}: no or unknown state {raw}"),
        })
    }

    /// `UpdateContainerResources` with Linux resources (containerd: task Update).
    pub fn update_resources(&self, id: &str, linux: LinuxContainerResources) -> Result<()> {
        let mut c = self.runtime.clone();
        let req = UpdateContainerResourcesRequest {
            container_id: id.to_owned(),
            linux: Some(linux),
            ..Default::default()
        };
        self.call(
            "UpdateContainerResources",
            c.update_container_resources(req),
        )
        .map(drop)
    }

    /// `ContainerStats` (containerd: task Metrics).
    pub fn container_stats(&self, id: &str) -> Result<ContainerStats> {
        let mut c = self.runtime.clone();
        let req = ContainerStatsRequest {
            container_id: id.to_owned(),
        };
        let r = self.call("ContainerStats", c.container_stats(req))?;
        r.stats.ok_or_else(|| Error::Cri {
            call: "ContainerStats",
            address: self.address.clone(),
            reason: format!("container {id}: no stats"),
        })
    }

    /// `StopContainer`: the stop signal, then SIGKILL after `grace`.
    pub fn stop_container(&self, id: &str, grace: Duration) -> Result<()> {
        let mut c = self.runtime.clone();
        let req = StopContainerRequest {
            container_id: id.to_owned(),
            timeout: grace.as_secs() as i64,
        };
        self.call("StopContainer", c.stop_container(req)).map(drop)
    }

    /// `RemoveContainer`.
    pub fn remove_container(&self, id: &str) -> Result<()> {
        let mut c = self.runtime.clone();
        let req = RemoveContainerRequest {
            container_id: id.to_owned(),
        };
        self.call("RemoveContainer", c.remove_container(req))
            .map(drop)
    }

    /// `StopPodSandbox`.
    pub fn stop_pod(&self, pod: &str) -> Result<()> {
        let mut c = self.runtime.clone();
        let req = StopPodSandboxRequest {
            pod_sandbox_id: pod.to_owned(),
        };
        self.call("StopPodSandbox", c.stop_pod_sandbox(req))
            .map(drop)
    }

    /// `RemovePodSandbox`.
    pub fn remove_pod(&self, pod: &str) -> Result<()> {
        let mut c = self.runtime.clone();
        let req = RemovePodSandboxRequest {
            pod_sandbox_id: pod.to_owned(),
        };
        self.call("RemovePodSandbox", c.remove_pod_sandbox(req))
            .map(drop)
    }

    /// `ListPodSandbox` ids.
    pub fn pods(&self) -> Result<Vec<String>> {
        let mut c = self.runtime.clone();
        let r = self.call(
            "ListPodSandbox",
            c.list_pod_sandbox(ListPodSandboxRequest::default()),
        )?;
        Ok(r.items.into_iter().map(|p| p.id).collect())
    }

    /// `ListContainers` ids.
    pub fn containers(&self) -> Result<Vec<String>> {
        let mut c = self.runtime.clone();
        let r = self.call(
            "ListContainers",
            c.list_containers(ListContainersRequest::default()),
        )?;
        Ok(r.containers.into_iter().map(|c| c.id).collect())
    }
}

/// A pod config the way the kubelet writes one for a host-network pod
/// (`NamespaceMode::Node`, so no CNI is involved).
pub fn host_network_pod(
    name: &str,
    uid: &str,
    annotations: &[(&str, &str)],
    log_dir: &Path,
) -> PodSandboxConfig {
    PodSandboxConfig {
        metadata: Some(PodSandboxMetadata {
            name: name.to_owned(),
            uid: uid.to_owned(),
            namespace: "default".to_owned(),
            attempt: 0,
        }),
        // The kubelet leaves it empty for host-network pods: the pod has
        // no UTS namespace of its own, and runc refuses to set a hostname then.
        hostname: String::new(),
        log_directory: log_dir.display().to_string(),
        annotations: annotations
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect(),
        linux: Some(LinuxPodSandboxConfig {
            security_context: Some(LinuxSandboxSecurityContext {
                namespace_options: Some(NamespaceOption {
                    network: NamespaceMode::Node as i32,
                    pid: NamespaceMode::Pod as i32,
                    ipc: NamespaceMode::Pod as i32,
                    ..Default::default()
                }),
                ..Default::default()
            }),
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// A container config: `name`, `image`, command and args, env.
pub fn container(
    name: &str,
    image: &str,
    command: &[&str],
    args: &[&str],
    env: &[(&str, &str)],
) -> ContainerConfig {
    ContainerConfig {
        metadata: Some(ContainerMetadata {
            name: name.to_owned(),
            attempt: 0,
        }),
        image: Some(ImageSpec {
            image: image.to_owned(),
            ..Default::default()
        }),
        command: command.iter().map(|s| (*s).to_owned()).collect(),
        args: args.iter().map(|s| (*s).to_owned()).collect(),
        envs: env
            .iter()
            .map(|(k, v)| KeyValue {
                key: (*k).to_owned(),
                value: (*v).to_owned(),
            })
            .collect(),
        log_path: format!("{name}.log"),
        ..Default::default()
    }
}
