//! OCI image archives made from a local rootfs directory, so that tests which
//! need a real image (the CRI plugin only runs images it has in its store)
//! work without a registry or a network: one uncompressed layer, a config
//! with the entrypoint, an OCI image layout, tarred for `ctr images import`.

use crate::{Error, Result};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use std::path::{Path, PathBuf};
use std::process::Command;

const MANIFEST: &str = "application/vnd.oci.image.manifest.v1+json";
const CONFIG: &str = "application/vnd.oci.image.config.v1+json";
const LAYER: &str = "application/vnd.oci.image.layer.v1.tar";

/// An image to build: a name (`host/repo:tag`) and what it runs.
#[derive(Debug, Clone)]
pub struct OciImage {
    name: String,
    entrypoint: Vec<String>,
    cmd: Vec<String>,
}

/// A blob written into the layout: its descriptor fields.
struct Blob {
    digest: String,
    size: u64,
}

impl OciImage {
    /// An image called `name`, e.g. `shadow.test/pause:1` (a dot in the
    /// first part keeps CRI from prefixing `docker.io/library/`).
    pub fn new(name: impl Into<String>) -> Self {
        OciImage {
            name: name.into(),
            entrypoint: Vec::new(),
            cmd: Vec::new(),
        }
    }

    /// The config's `Entrypoint`.
    pub fn entrypoint<S: AsRef<str>>(mut self, argv: &[S]) -> Self {
        self.entrypoint = argv.iter().map(|a| a.as_ref().to_owned()).collect();
        self
    }

    /// The config's `Cmd`.
    pub fn cmd<S: AsRef<str>>(mut self, argv: &[S]) -> Self {
        self.cmd = argv.iter().map(|a| a.as_ref().to_owned()).collect();
        self
    }

    /// The image's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Write an OCI image layout of `rootfs` under `work` and tar it into
    /// `work/<file-safe name>.tar`; returns the archive's path.
    pub fn write_archive(&self, rootfs: &Path, work: &Path) -> Result<PathBuf> {
        let safe: String = self
            .name
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '-' })
            .collect();
        let layout = work.join(format!("{safe}.layout"));
        let blobs = layout.join("blobs/sha256");
        std::fs::create_dir_all(&blobs).map_err(|e| Error::io("create dir", &blobs, e))?;

        // The layer: the rootfs as a plain tar, owners kept numeric.
        let layer_tmp = layout.join("layer.tar");
        run_tar(
            Command::new("tar")
                .arg("--numeric-owner")
                .arg("-C")
                .arg(rootfs)
                .arg("-cf")
                .arg(&layer_tmp)
                .arg("."),
            &layer_tmp,
        )?;
        let layer = move_into_blobs(&layer_tmp, &blobs)?;

        let config = json!({
            "architecture": "amd64",
            "os": "linux",
            "config": {
                "Entrypoint": self.entrypoint,
                "Cmd": self.cmd,
                "Env": ["PATH=/bin:/sbin:/usr/bin:/usr/sbin"],
                "WorkingDir": "/",
            },
            "rootfs": { "type": "layers", "diff_ids": [layer.digest] },
        });
        let config = write_blob(&blobs, &config)?;
        let manifest = json!({
            "schemaVersion": 2,
            "mediaType": MANIFEST,
            "config": { "mediaType": CONFIG, "digest": config.digest, "size": config.size },
            "layers": [{ "mediaType": LAYER, "digest": layer.digest, "size": layer.size }],
        });
        let manifest = write_blob(&blobs, &manifest)?;
        let tag = self.name.rsplit(':').next().unwrap_or("latest");
        let index = json!({
            "schemaVersion": 2,
            "manifests": [{
                "mediaType": MANIFEST,
                "digest": manifest.digest,
                "size": manifest.size,
                "platform": { "architecture": "amd64", "os": "linux" },
                // containerd names the imported image after this annotation.
                "annotations": {
                    "io.containerd.image.name": self.name,
                    "org.opencontainers.image.ref.name": tag,
                },
            }],
        });
        write_json(&layout.join("index.json"), &index)?;
        write_json(
            &layout.join("oci-layout"),
            &json!({ "imageLayoutVersion": "1.0.0" }),
        )?;

        let archive = work.join(format!("{safe}.tar"));
        run_tar(
            Command::new("tar")
                .arg("-C")
                .arg(&layout)
                .arg("-cf")
                .arg(&archive)
                .args(["oci-layout", "index.json", "blobs"]),
            &archive,
        )?;
        std::fs::remove_dir_all(&layout).map_err(|e| Error::io("remove layout", &layout, e))?;
        Ok(archive)
    }
}

fn run_tar(cmd: &mut Command, out: &Path) -> Result<()> {
    let o = cmd.output().map_err(|e| Error::Spawn {
        program: "tar".into(),
        source: e,
    })?;
    if o.status.success() {
        Ok(())
    } else {
        Err(Error::io(
            "tar",
            out,
            std::io::Error::other(String::from_utf8_lossy(&o.stderr).into_owned()),
        ))
    }
}

fn sha256_file(path: &Path) -> Result<(String, u64)> {
    let mut f = std::fs::File::open(path).map_err(|e| Error::io("open blob", path, e))?;
    let mut h = Sha256::new();
    let size = std::io::copy(&mut f, &mut h).map_err(|e| Error::io("hash blob", path, e))?;
    Ok((format!("sha256:{:x}", h.finalize()), size))
}

fn move_into_blobs(file: &Path, blobs: &Path) -> Result<Blob> {
    let (digest, size) = sha256_file(file)?;
    let dst = blobs.join(digest.trim_start_matches("sha256:"));
    std::fs::rename(file, &dst).map_err(|e| Error::io("move blob", &dst, e))?;
    Ok(Blob { digest, size })
}

fn write_blob(blobs: &Path, v: &Value) -> Result<Blob> {
    let bytes = serde_json::to_vec(v).map_err(|e| Error::io("encode json", blobs, e.into()))?;
    let digest = format!("sha256:{:x}", Sha256::digest(&bytes));
    let dst = blobs.join(digest.trim_start_matches("sha256:"));
    std::fs::write(&dst, &bytes).map_err(|e| Error::io("write blob", &dst, e))?;
    Ok(Blob {
        digest,
        size: bytes.len() as u64,
    })
}

fn write_json(path: &Path, v: &Value) -> Result<()> {
    let bytes = serde_json::to_vec(v).map_err(|e| Error::io("encode json", path, e.into()))?;
    std::fs::write(path, bytes).map_err(|e| Error::io("write", path, e))
}
