//! The rootfs mounts containerd hands to Create, made in the bundle and
//! undone at Delete. Plain containers and pairs mount the same way.

use std::path::Path;

use containerd_shim_protos::api::Mount;

use crate::error::{Error, Result};

/// Detach every mount at or below `target`; a failure is logged, because
/// the caller is already undoing and has nothing better to do with it.
pub async fn unmount(target: &Path) {
    let t = target.display().to_string();
    let res = tokio::task::spawn_blocking(move || {
        containerd_shim::mount::umount_recursive(Some(&t), libc::MNT_DETACH)
    })
    .await;
    if !matches!(res, Ok(Ok(()))) {
        log::warn!("unmounting {}: {res:?}", target.display());
    }
}

/// Mount `mounts` on `target` (created if missing), in order. A mount the
/// kernel refuses is the request's fault: InvalidArgument naming it.
pub async fn mount_all(mounts: &[Mount], target: &Path) -> Result<()> {
    std::fs::create_dir_all(target)
        .map_err(|e| Error::io(format!("creating rootfs {}", target.display()), e))?;
    for m in mounts {
        let (ty, src, opts, dst) = (
            m.type_.clone(),
            m.source.clone(),
            m.options.clone(),
            target.to_path_buf(),
        );
        tokio::task::spawn_blocking(move || {
            let opt = |s: &str| Some(s.to_string()).filter(|s| !s.is_empty());
            containerd_shim::mount::mount_rootfs(
                opt(&ty).as_deref(),
                opt(&src).as_deref(),
                &opts,
                &dst,
            )
        })
        .await
        .map_err(|e| Error::io("mount task", std::io::Error::other(e)))?
        .map_err(|e| {
            Error::InvalidArgument(format!(
                "mounting {} ({}) on {}: {e}",
                m.source,
                m.type_,
                target.display()
            ))
        })?;
    }
    Ok(())
}
