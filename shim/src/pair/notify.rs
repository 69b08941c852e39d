//! The pair's sd_notify socket: one `SOCK_DGRAM` Unix socket in the pair
//! directory, bound by the shim and seen by both engines. Identity never
//! comes from the message text: `SO_PASSCRED` makes the kernel attach the
//! sender's pid (translated into the shim's pid namespace), and the
//! supervisor maps that pid to a slot through its cgroup.

use std::os::fd::AsRawFd;
use std::path::Path;

use nix::sys::socket::{recvmsg, setsockopt, sockopt, ControlMessageOwned, MsgFlags, UnixAddr};
use tokio::io::Interest;
use tokio::net::UnixDatagram;

use crate::error::{Error, Result};

/// One datagram and who sent it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Datagram {
    pub pid: u32,
    pub bytes: Vec<u8>,
}

pub struct NotifySocket {
    sock: UnixDatagram,
}

impl NotifySocket {
    /// Bind at `path` (replacing a stale file), world-writable so that
    /// engines running as any user can notify.
    pub fn bind(path: &Path) -> Result<Self> {
        let _ = std::fs::remove_file(path);
        let sock = UnixDatagram::bind(path)
            .map_err(|e| Error::io(format!("binding notify socket {}", path.display()), e))?;
        setsockopt(&sock, sockopt::PassCred, &true).map_err(|e| {
            Error::sys(
                format!(
                    "SO_PASSCRED on notify socket {} (fd {})",
                    path.display(),
                    sock.as_raw_fd()
                ),
                e,
            )
        })?;
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o666))
            .map_err(|e| Error::io(format!("chmod notify socket {}", path.display()), e))?;
        Ok(NotifySocket { sock })
    }

    /// The next datagram that carries credentials; others are dropped.
    pub async fn recv(&self) -> Result<Datagram> {
        loop {
            let got = self
                .sock
                .async_io(Interest::READABLE, || {
                    let mut buf = vec![0u8; shadow_pair_max()];
                    let mut cmsg = nix::cmsg_space!(nix::sys::socket::UnixCredentials);
                    let mut iov = [std::io::IoSliceMut::new(&mut buf)];
                    let msg = recvmsg::<UnixAddr>(
                        self.sock.as_raw_fd(),
                        &mut iov,
                        Some(&mut cmsg),
                        MsgFlags::MSG_DONTWAIT | MsgFlags::MSG_TRUNC,
                    )
                    .map_err(std::io::Error::from)?;
                    let mut pid = None;
                    if let Ok(cmsgs) = msg.cmsgs() {
                        for c in cmsgs {
                            if let ControlMessageOwned::ScmCredentials(cred) = c {
                                pid = Some(cred.pid());
                            }
                        }
                    }
                    let len = msg.bytes.min(buf.len());
                    buf.truncate(len);
                    Ok((pid, buf))
                })
                .await
                .map_err(|e| Error::io("reading the notify socket", e))?;
            if let (Some(pid), bytes) = got {
                if pid > 0 {
                    return Ok(Datagram {
                        pid: pid as u32,
                        bytes,
                    });
                }
            }
        }
    }
}

fn shadow_pair_max() -> usize {
    4096
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn sender_pid_comes_from_the_kernel() {
        let d = tempfile::tempdir().unwrap();
        let p = d.path().join("notify.sock");
        let s = NotifySocket::bind(&p).unwrap();
        // A real other process sends, as an engine would.
        let status = std::process::Command::new("python3")
            .args([
                "-c",
                "import socket,sys; s=socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM); s.sendto(b'READY=1', sys.argv[1])",
            ])
            .arg(&p)
            .spawn();
        let Ok(mut child) = status else {
            // No python3: send from this process instead.
            let c = std::os::unix::net::UnixDatagram::unbound().unwrap();
            c.send_to(b"READY=1", &p).unwrap();
            let d = s.recv().await.unwrap();
            assert_eq!(d.pid, std::process::id());
            assert_eq!(d.bytes, b"READY=1");
            return;
        };
        let pid = child.id();
        let d = s.recv().await.unwrap();
        assert!(child.wait().unwrap().success());
        assert_eq!(d.pid, pid);
        assert_eq!(d.bytes, b"READY=1");
    }
}
