//! A busybox-static root filesystem for test containers: small, built in a
//! blink from the host's `busybox` (Debian package busybox-static), and with
//! every applet a test might call (`sh`, `cat`, `sleep`, `tty`, …).

use crate::{Error, Result};
use std::path::{Path, PathBuf};
use std::process::Command;

/// Builder for a busybox rootfs directory.
#[derive(Debug, Clone, Default)]
pub struct Rootfs {
    files: Vec<(PathBuf, String, u32)>,
}

impl Rootfs {
    /// The default: busybox + applet links, /proc /sys /dev /tmp /run, and
    /// an /etc/passwd and /etc/group that know root and nobody.
    pub fn busybox() -> Self {
        Rootfs::default()
    }

    /// Add a file (path relative to the rootfs) with the given mode.
    pub fn file(
        mut self,
        path: impl Into<PathBuf>,
        contents: impl Into<String>,
        mode: u32,
    ) -> Self {
        self.files.push((path.into(), contents.into(), mode));
        self
    }

    /// Build the rootfs at `dir` (created) and return its path.
    pub fn build(&self, dir: &Path) -> Result<PathBuf> {
        use std::os::unix::fs::PermissionsExt;
        let busybox = find_busybox()?;
        for d in ["bin", "proc", "sys", "dev", "tmp", "etc", "run", "root"] {
            let p = dir.join(d);
            std::fs::create_dir_all(&p).map_err(|e| Error::io("create rootfs dir", &p, e))?;
        }
        let tmp = dir.join("tmp");
        std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o1777))
            .map_err(|e| Error::io("chmod rootfs /tmp", &tmp, e))?;
        let target = dir.join("bin/busybox");
        std::fs::copy(&busybox, &target).map_err(|e| Error::io("copy busybox", &busybox, e))?;
        // Applet links, as `busybox --install -s /bin` would make them, but
        // without chroot-ing into the rootfs.
        let list = Command::new(&busybox)
            .arg("--list")
            .output()
            .map_err(|e| Error::io("busybox --list", &busybox, e))?;
        for applet in String::from_utf8_lossy(&list.stdout).lines() {
            let applet = applet.trim();
            if applet.is_empty() || applet == "busybox" || applet.contains('/') {
                continue;
            }
            let link = dir.join("bin").join(applet);
            if !link.exists() {
                std::os::unix::fs::symlink("/bin/busybox", &link)
                    .map_err(|e| Error::io("link busybox applet", &link, e))?;
            }
        }
        let mut files = vec![
            (
                PathBuf::from("etc/passwd"),
                "root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n"
                    .to_owned(),
                0o644,
            ),
            (
                PathBuf::from("etc/group"),
                "root:x:0:\nnobody:x:65534:\n".to_owned(),
                0o644,
            ),
        ];
        files.extend(self.files.iter().cloned());
        for (rel, contents, mode) in files {
            let p = dir.join(rel);
            if let Some(parent) = p.parent() {
                std::fs::create_dir_all(parent)
                    .map_err(|e| Error::io("create rootfs dir", parent, e))?;
            }
            std::fs::write(&p, contents).map_err(|e| Error::io("write rootfs file", &p, e))?;
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(mode))
                .map_err(|e| Error::io("chmod rootfs file", &p, e))?;
        }
        Ok(dir.to_owned())
    }
}

/// The host's static busybox.
fn find_busybox() -> Result<PathBuf> {
    for p in ["/bin/busybox", "/usr/bin/busybox"] {
        let path = Path::new(p);
        if path.is_file() {
            // A dynamically linked busybox (package `busybox`) cannot run in a
            // rootfs without libc; its ELF header names the loader early on.
            let head = std::fs::read(path).map_err(|e| Error::io("read busybox", path, e))?;
            let head = &head[..head.len().min(4096)];
            if head.windows(8).any(|w| w == b"ld-linux") {
                return Err(Error::MissingTool {
                    tool: "busybox (statically linked)",
                    package: "busybox-static",
                });
            }
            return Ok(path.to_owned());
        }
    }
    Err(Error::MissingTool {
        tool: "busybox",
        package: "busybox-static",
    })
}
