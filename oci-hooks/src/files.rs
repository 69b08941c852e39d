//! Replacing a file whole. The hooks write files that runtimes and other
//! hooks read at any moment (CDI specs a runtime rescans, the admission
//! rules every hook reads): a reader must see the old file or the new one,
//! never half of either, and no link planted in the directory may redirect
//! the write.

use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::path::Path;

use crate::error::{Error, Result};

/// Replace `path` with `bytes`: a temporary file of a fresh, unpredictable
/// name beside it (created `O_EXCL`, so nothing there is followed) with
/// `mode`, synced, then renamed over `path`. `what` names the file in
/// errors.
pub fn replace(path: &Path, bytes: &[u8], mode: u32, what: &'static str) -> Result<()> {
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let mut tmp = tempfile::Builder::new()
        .prefix(".shadow-")
        .suffix(".tmp")
        .permissions(std::fs::Permissions::from_mode(mode))
        .tempfile_in(dir)
        .map_err(|e| Error::io(what, dir, e))?;
    tmp.write_all(bytes)
        .and_then(|()| tmp.as_file().sync_all())
        .map_err(|e| Error::io(what, tmp.path(), e))?;
    tmp.persist(path)
        .map(drop)
        .map_err(|e| Error::io(what, path, e.error))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replaces_whole_with_the_mode_and_follows_no_link() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("admission.json");
        replace(&p, b"one", 0o600, "rules").unwrap();
        replace(&p, b"two", 0o600, "rules").unwrap();
        assert_eq!(std::fs::read(&p).unwrap(), b"two");
        assert_eq!(
            std::fs::metadata(&p).unwrap().permissions().mode() & 0o777,
            0o600
        );
        assert_eq!(std::fs::read_dir(d.path()).unwrap().count(), 1);
        // The name the old code used for its temporary file, planted as a
        // link to a file the writer must not touch.
        let victim = d.path().join("victim");
        std::fs::write(&victim, "keep").unwrap();
        std::os::unix::fs::symlink(&victim, d.path().join("admission.json.tmp")).unwrap();
        replace(&p, b"three", 0o600, "rules").unwrap();
        assert_eq!(std::fs::read_to_string(&victim).unwrap(), "keep");
        let e = replace(&d.path().join("no/such/dir/f"), b"x", 0o644, "spec").unwrap_err();
        assert!(e.to_string().contains("no/such/dir"), "{e}");
    }
}
