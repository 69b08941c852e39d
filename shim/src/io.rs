//! Process stdio: containerd's FIFOs on one side, the container on the other.
//!
//! Without a terminal, the container gets anonymous pipes and the shim copies
//! between them and the FIFOs (as runc-v2 does), so CloseIO can close the
//! container's stdin and a restarting containerd does not break the
//! container's output. The FIFOs are opened read-write so that they stay
//! valid while containerd's end is away. With a terminal, runc hands the pty
//! master over a console socket and the shim copies between it and the FIFOs.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixListener;
use std::path::{Path, PathBuf};
use std::process::Stdio as ChildStdioKind;
use std::sync::Mutex;

use async_trait::async_trait;
use nix::sys::socket::{recvmsg, ControlMessageOwned, MsgFlags};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::unix::pipe;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::error::{Error, Result};
use crate::status::Stdio;

/// The container's ends of its stdio, handed to runc for one command.
/// Dropped (and so closed in the shim) as soon as runc has started the
/// process, so that EOF reaches the copiers when the container exits.
#[derive(Debug, Default)]
pub struct ChildStdio {
    stdin: Mutex<Option<OwnedFd>>,
    stdout: Mutex<Option<OwnedFd>>,
    stderr: Mutex<Option<OwnedFd>>,
}

fn take(slot: &Mutex<Option<OwnedFd>>) -> Option<OwnedFd> {
    slot.lock().unwrap_or_else(|p| p.into_inner()).take()
}

fn dup_of(slot: &Mutex<Option<OwnedFd>>) -> std::io::Result<Option<OwnedFd>> {
    let guard = slot.lock().unwrap_or_else(|p| p.into_inner());
    guard.as_ref().map(|fd| fd.try_clone()).transpose()
}

#[async_trait]
impl runc::io::Io for ChildStdio {
    async fn set(&self, cmd: &mut runc::Command) -> std::io::Result<()> {
        // An absent stream is /dev/null, never the shim's own stdio.
        let pick = |fd: Option<OwnedFd>| {
            fd.map(ChildStdioKind::from)
                .unwrap_or_else(ChildStdioKind::null)
        };
        cmd.stdin(pick(dup_of(&self.stdin)?));
        cmd.stdout(pick(dup_of(&self.stdout)?));
        cmd.stderr(pick(dup_of(&self.stderr)?));
        Ok(())
    }

    async fn close_after_start(&self) {
        drop((take(&self.stdin), take(&self.stdout), take(&self.stderr)));
    }
}

/// The shim's side of one process's stdio.
#[derive(Debug, Default)]
pub struct ProcessIo {
    /// Copier FIFO → container stdin; aborting it closes the container's stdin.
    stdin: Option<JoinHandle<()>>,
    /// Copiers to the FIFOs; they end (and this channel closes) at EOF.
    outputs: Vec<JoinHandle<()>>,
    drained: Option<mpsc::Receiver<()>>,
    /// The pty master, for resizing.
    console: Option<OwnedFd>,
}

impl ProcessIo {
    /// Pipes for a process without a terminal: returns runc's ends and ours.
    /// `owner` (`IoUid`/`IoGid`) gets the container's ends, as runc-v2 does,
    /// so that a process in a user namespace may reopen them
    /// (`/proc/self/fd/1`).
    pub fn pipes(stdio: &Stdio, owner: Option<(u32, u32)>) -> Result<(ChildStdio, ProcessIo)> {
        let child = ChildStdio::default();
        let mut io = ProcessIo::default();
        let (done_tx, done_rx) = mpsc::channel::<()>(1);
        if !stdio.stdin.is_empty() {
            let fifo = pipe::OpenOptions::new()
                .read_write(true)
                .open_receiver(&stdio.stdin)
                .map_err(|e| Error::io(format!("opening stdin FIFO {}", stdio.stdin), e))?;
            let (tx, rx) = pipe::pipe().map_err(|e| Error::io("creating stdin pipe", e))?;
            let end = rx
                .into_blocking_fd()
                .map_err(|e| Error::io("stdin pipe", e))?;
            chown_end(&end, owner, "stdin")?;
            *child.stdin.lock().unwrap_or_else(|p| p.into_inner()) = Some(end);
            io.stdin = Some(tokio::spawn(copy(fifo, tx, None)));
        }
        for (path, slot) in [
            (&stdio.stdout, &child.stdout),
            (&stdio.stderr, &child.stderr),
        ] {
            if path.is_empty() {
                continue;
            }
            let fifo = open_output_fifo(path)?;
            let (tx, rx) = pipe::pipe().map_err(|e| Error::io("creating output pipe", e))?;
            let end = tx
                .into_blocking_fd()
                .map_err(|e| Error::io("output pipe", e))?;
            chown_end(&end, owner, path)?;
            *slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(end);
            io.outputs
                .push(tokio::spawn(copy(rx, fifo, Some(done_tx.clone()))));
        }
        io.drained = Some(done_rx);
        Ok((child, io))
    }

    /// Only a stdin pipe, fed from the FIFO at `path`: returns the
    /// container's (read) end and the shim's side, whose `close_stdin`
    /// (CloseIO) or drop gives the reader EOF. For an engine pair, whose
    /// output is wired separately.
    pub fn stdin_pipe(path: &str) -> Result<(OwnedFd, ProcessIo)> {
        let mut io = ProcessIo::default();
        let fifo = pipe::OpenOptions::new()
            .read_write(true)
            .open_receiver(path)
            .map_err(|e| Error::io(format!("opening stdin FIFO {path}"), e))?;
        let (tx, rx) = pipe::pipe().map_err(|e| Error::io("creating stdin pipe", e))?;
        let end = rx
            .into_blocking_fd()
            .map_err(|e| Error::io("stdin pipe", e))?;
        io.stdin = Some(tokio::spawn(copy(fifo, tx, None)));
        Ok((end, io))
    }

    /// Wire a pty master received from runc to the FIFOs.
    pub fn console(master: OwnedFd, stdio: &Stdio) -> Result<ProcessIo> {
        let mut io = ProcessIo::default();
        let (done_tx, done_rx) = mpsc::channel::<()>(1);
        let dup = |what: &str| {
            master
                .try_clone()
                .map_err(|e| Error::io(format!("duplicating pty master for {what}"), e))
        };
        if !stdio.stdin.is_empty() {
            let fifo = pipe::OpenOptions::new()
                .read_write(true)
                .open_receiver(&stdio.stdin)
                .map_err(|e| Error::io(format!("opening stdin FIFO {}", stdio.stdin), e))?;
            let to_pty = pipe::Sender::from_owned_fd_unchecked(dup("stdin")?)
                .map_err(|e| Error::io("registering pty master", e))?;
            io.stdin = Some(tokio::spawn(copy(fifo, to_pty, None)));
        }
        if !stdio.stdout.is_empty() {
            let fifo = open_output_fifo(&stdio.stdout)?;
            let from_pty = pipe::Receiver::from_owned_fd_unchecked(dup("stdout")?)
                .map_err(|e| Error::io("registering pty master", e))?;
            io.outputs
                .push(tokio::spawn(copy(from_pty, fifo, Some(done_tx.clone()))));
        }
        io.console = Some(master);
        io.drained = Some(done_rx);
        Ok(io)
    }

    /// The receiver that closes when all output has been copied.
    pub fn take_drained(&mut self) -> Option<mpsc::Receiver<()>> {
        self.drained.take()
    }

    /// Close the container's stdin (CloseIO).
    pub fn close_stdin(&mut self) {
        if let Some(task) = self.stdin.take() {
            task.abort();
        }
    }

    /// Set the terminal's size. A process without a terminal has nothing
    /// to resize, and that is not an error (as in runc-v2, whose clients
    /// resize whatever they attached to).
    pub fn resize(&self, width: u32, height: u32) -> Result<()> {
        let Some(master) = &self.console else {
            return Ok(());
        };
        let ws = libc::winsize {
            ws_row: height.min(u16::MAX as u32) as u16,
            ws_col: width.min(u16::MAX as u32) as u16,
            ws_xpixel: 0,
            ws_ypixel: 0,
        };
        // SAFETY: TIOCSWINSZ reads one `winsize` from the pointer, which is
        // valid for the call; the fd is a pty master we own.
        let rc = unsafe { libc::ioctl(master.as_raw_fd(), libc::TIOCSWINSZ, &ws) };
        if rc < 0 {
            return Err(Error::io(
                format!("resizing pty (fd {})", master.as_raw_fd()),
                std::io::Error::last_os_error(),
            ));
        }
        Ok(())
    }
}

impl Drop for ProcessIo {
    fn drop(&mut self) {
        self.close_stdin();
        for t in &self.outputs {
            t.abort();
        }
    }
}

/// Give the container's end of a pipe to `owner`.
fn chown_end(end: &OwnedFd, owner: Option<(u32, u32)>, what: &str) -> Result<()> {
    let Some((uid, gid)) = owner else {
        return Ok(());
    };
    nix::unistd::fchown(
        end,
        Some(nix::unistd::Uid::from_raw(uid)),
        Some(nix::unistd::Gid::from_raw(gid)),
    )
    .map_err(|e| {
        Error::sys(
            format!("giving the {what} pipe to {uid}:{gid} (IoUid/IoGid)"),
            e,
        )
    })
}

fn open_output_fifo(path: &str) -> Result<pipe::Sender> {
    pipe::OpenOptions::new()
        .read_write(true)
        .open_sender(path)
        .map_err(|e| Error::io(format!("opening output FIFO {path}"), e))
}

async fn copy<R, W>(mut from: R, mut to: W, _done: Option<mpsc::Sender<()>>)
where
    R: AsyncRead + Unpin,
    W: AsyncWrite + Unpin,
{
    // Small buffer: the shim must stay small, and this is not a hot path.
    let mut reader = tokio::io::BufReader::with_capacity(8 * 1024, &mut from);
    // EIO from a pty master whose slave closed is its normal EOF.
    let _ = tokio::io::copy_buf(&mut reader, &mut to).await;
    // `_done` drops here: the drain waiter learns this stream is finished.
}

/// A listening socket runc connects to with the pty master (`--console-socket`).
pub struct ConsoleSocket {
    dir: tempfile::TempDir,
    listener: UnixListener,
}

impl ConsoleSocket {
    pub fn new() -> Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix("shadow-pty")
            .tempdir()
            .map_err(|e| Error::io("creating console socket directory", e))?;
        let path = dir.path().join("pty.sock");
        let listener = UnixListener::bind(&path)
            .map_err(|e| Error::io(format!("binding console socket {}", path.display()), e))?;
        Ok(ConsoleSocket { dir, listener })
    }

    pub fn path(&self) -> PathBuf {
        self.dir.path().join("pty.sock")
    }

    /// Receive the master runc sent (runc has already connected and sent it
    /// by the time its command returned, so this does not wait long).
    pub async fn receive(self) -> Result<OwnedFd> {
        tokio::task::spawn_blocking(move || {
            let (stream, _) = self
                .listener
                .accept()
                .map_err(|e| Error::io(format!("accepting on {}", self.path().display()), e))?;
            receive_fd(stream.as_raw_fd(), &self.path())
        })
        .await
        .map_err(|e| Error::io("console receive task", std::io::Error::other(e)))?
    }
}

fn receive_fd(sock: RawFd, path: &Path) -> Result<OwnedFd> {
    let mut name = [0u8; 4096];
    let mut iov = [std::io::IoSliceMut::new(&mut name)];
    let mut space = nix::cmsg_space!([RawFd; 1]);
    let msg = recvmsg::<()>(sock, &mut iov, Some(&mut space), MsgFlags::MSG_CMSG_CLOEXEC)
        .map_err(|e| Error::sys(format!("receiving pty master on {}", path.display()), e))?;
    let mut fds = Vec::new();
    for cmsg in msg
        .cmsgs()
        .map_err(|e| Error::sys("reading control message", e))?
    {
        if let ControlMessageOwned::ScmRights(list) = cmsg {
            fds.extend(list);
        }
    }
    let mut owned: Vec<OwnedFd> = fds
        .into_iter()
        // SAFETY: SCM_RIGHTS just installed these descriptors in our table;
        // nothing else refers to them, so each gets exactly one owner here.
        .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) })
        .collect();
    if owned.len() != 1 {
        return Err(Error::InvalidArgument(format!(
            "console socket {}: expected one pty master, got {} descriptors",
            path.display(),
            owned.len()
        )));
    }
    owned
        .pop()
        .ok_or_else(|| Error::InvalidArgument("no pty master received".into()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    #[tokio::test]
    async fn pipes_copy_between_fifos_and_child_ends() {
        let dir = tempfile::tempdir().unwrap();
        let (i, o) = (dir.path().join("in"), dir.path().join("out"));
        for p in [&i, &o] {
            nix::unistd::mkfifo(p, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        }
        let stdio = Stdio {
            stdin: i.display().to_string(),
            stdout: o.display().to_string(),
            stderr: String::new(),
            terminal: false,
        };
        let mut reader = pipe::OpenOptions::new().open_receiver(&o).unwrap();
        let (child, mut io) = ProcessIo::pipes(&stdio, None).unwrap();
        let mut writer = pipe::OpenOptions::new().open_sender(&i).unwrap();
        let child_in = take(&child.stdin).unwrap();
        let child_out = take(&child.stdout).unwrap();
        assert!(take(&child.stderr).is_none());

        // FIFO -> child stdin
        writer.write_all(b"ping\n").await.unwrap();
        let mut rx = pipe::Receiver::from_owned_fd(child_in).unwrap();
        let mut buf = [0u8; 5];
        rx.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"ping\n");
        // CloseIO: the child sees EOF on stdin.
        io.close_stdin();
        let mut rest = Vec::new();
        rx.read_to_end(&mut rest).await.unwrap();
        assert!(rest.is_empty());

        // child stdout -> FIFO, then drained once the child end closes.
        let mut tx = pipe::Sender::from_owned_fd(child_out).unwrap();
        tx.write_all(b"pong\n").await.unwrap();
        drop(tx);
        reader.read_exact(&mut buf).await.unwrap();
        assert_eq!(&buf, b"pong\n");
        let mut drained = io.take_drained().unwrap();
        assert!(drained.recv().await.is_none());
    }

    #[test]
    fn resize_without_terminal_does_nothing_and_succeeds() {
        // runc-v2 answers OK (TestTaskResize of containerd's suite).
        let io = ProcessIo::default();
        io.resize(80, 24).unwrap();
    }

    #[tokio::test]
    async fn io_owner_gets_the_containers_ends_of_the_pipes() {
        use std::os::unix::fs::MetadataExt;
        let dir = tempfile::tempdir().unwrap();
        let (i, o) = (dir.path().join("in"), dir.path().join("out"));
        for p in [&i, &o] {
            nix::unistd::mkfifo(p, nix::sys::stat::Mode::from_bits_truncate(0o600)).unwrap();
        }
        let stdio = Stdio {
            stdin: i.display().to_string(),
            stdout: o.display().to_string(),
            stderr: String::new(),
            terminal: false,
        };
        let owner_of = |fd: &OwnedFd| {
            let m = std::fs::metadata(format!("/proc/self/fd/{}", fd.as_raw_fd())).unwrap();
            (m.uid(), m.gid())
        };
        let (child, _io) = ProcessIo::pipes(&stdio, Some((1000, 2000))).unwrap();
        for end in [take(&child.stdin).unwrap(), take(&child.stdout).unwrap()] {
            assert_eq!(owner_of(&end), (1000, 2000));
        }
        let (child, _io) = ProcessIo::pipes(&stdio, None).unwrap();
        let me = (
            nix::unistd::geteuid().as_raw(),
            nix::unistd::getegid().as_raw(),
        );
        assert_eq!(owner_of(&take(&child.stdout).unwrap()), me);
    }
}
