//! OOM notifications for a container's cgroup, published as `/tasks/oom`.
//! cgroup v1: an eventfd registered on `memory.oom_control` through
//! `cgroup.event_control`. cgroup v2: inotify on `memory.events`, reporting
//! when `oom_kill` grows. Either watcher ends when the cgroup disappears.
//! The memory directory comes from `stats` (cgroups-rs), as the metrics do.

use std::ffi::CString;
use std::fs::File;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};

use cgroups_rs::fs::Cgroup;
use nix::sys::eventfd::{EfdFlags, EventFd};
use tokio::io::unix::AsyncFd;
use tokio::task::JoinHandle;

use crate::error::{Error, Result};
use crate::stats::{keyed, memory_dir};

/// How many processes of `cg` the OOM killer has killed (`oom_kill` of
/// v2's `memory.events`, which counts the subtree's victims, or of v1's
/// `memory.oom_control`, the cgroup's own); 0 when the cgroup or the
/// counter is not there.
pub fn kills(cg: &Cgroup) -> u64 {
    let Some(dir) = memory_dir(cg) else {
        return 0;
    };
    let file = if cg.v2() {
        "memory.events"
    } else {
        "memory.oom_control"
    };
    keyed(&dir, file).remove("oom_kill").unwrap_or(0)
}

/// Start watching the memory cgroup of `cg`; `on_oom` runs for each OOM.
pub fn watch(cg: &Cgroup, on_oom: impl Fn() + Send + 'static) -> Result<Option<JoinHandle<()>>> {
    let Some(dir) = memory_dir(cg) else {
        return Ok(None);
    };
    if cg.v2() {
        watch_v2(dir, on_oom).map(Some)
    } else {
        watch_v1(dir, on_oom).map(Some)
    }
}

fn watch_v1(dir: PathBuf, on_oom: impl Fn() + Send + 'static) -> Result<JoinHandle<()>> {
    let efd = EventFd::from_value_and_flags(0, EfdFlags::EFD_CLOEXEC | EfdFlags::EFD_NONBLOCK)
        .map_err(|e| Error::sys("creating OOM eventfd", e))?;
    let control_path = dir.join("memory.oom_control");
    let control = File::open(&control_path)
        .map_err(|e| Error::io(format!("opening {}", control_path.display()), e))?;
    let register = dir.join("cgroup.event_control");
    std::fs::write(
        &register,
        format!("{} {}", efd.as_raw_fd(), control.as_raw_fd()),
    )
    .map_err(|e| {
        Error::io(
            format!("registering OOM eventfd in {}", register.display()),
            e,
        )
    })?;
    // SAFETY: the EventFd owns its descriptor and moves into the AsyncFd,
    // so the fd stays open and unchanged for the AsyncFd's whole life.
    let afd = unsafe { AsyncFd::register(efd) }
        .map_err(|e| Error::io("polling OOM eventfd", std::io::Error::other(e.to_string())))?;
    Ok(tokio::spawn(async move {
        // The registration lives as long as `control` is open.
        let _control = control;
        loop {
            let Ok(mut guard) = afd.readable().await else {
                return;
            };
            match guard.try_io(|fd| fd.get_ref().read().map_err(std::io::Error::from)) {
                Ok(Ok(_)) => {
                    // The kernel also signals when the cgroup is removed.
                    if !dir.exists() {
                        return;
                    }
                    on_oom();
                }
                Ok(Err(_)) => return,
                Err(_would_block) => continue,
            }
        }
    }))
}

/// inotify instance owning its descriptor.
struct Inotify(OwnedFd);

impl AsRawFd for Inotify {
    fn as_raw_fd(&self) -> std::os::fd::RawFd {
        self.0.as_raw_fd()
    }
}

fn watch_v2(dir: PathBuf, on_oom: impl Fn() + Send + 'static) -> Result<JoinHandle<()>> {
    let events = dir.join("memory.events");
    // SAFETY: inotify_init1 takes flags only; the result is checked below.
    let fd = unsafe { libc::inotify_init1(libc::IN_CLOEXEC | libc::IN_NONBLOCK) };
    if fd < 0 {
        return Err(Error::io("inotify_init1", std::io::Error::last_os_error()));
    }
    // SAFETY: fd was just returned by inotify_init1 and is owned by nobody else.
    let ino = Inotify(unsafe { OwnedFd::from_raw_fd(fd) });
    let cpath = CString::new(events.as_os_str().as_encoded_bytes())
        .map_err(|_| Error::InvalidArgument(format!("NUL in {}", events.display())))?;
    // SAFETY: cpath is a valid NUL-terminated string for the duration of the call.
    let wd = unsafe { libc::inotify_add_watch(ino.as_raw_fd(), cpath.as_ptr(), libc::IN_MODIFY) };
    if wd < 0 {
        return Err(Error::io(
            format!("watching {}", events.display()),
            std::io::Error::last_os_error(),
        ));
    }
    // SAFETY: `Inotify` owns its descriptor and moves into the AsyncFd, so
    // the fd stays open and unchanged for the AsyncFd's whole life.
    let afd = unsafe { AsyncFd::register(ino) }
        .map_err(|e| Error::io("polling inotify", std::io::Error::other(e.to_string())))?;
    let oom_kills = |d: &Path| keyed(d, "memory.events").remove("oom_kill").unwrap_or(0);
    let mut seen = oom_kills(&dir);
    Ok(tokio::spawn(async move {
        let mut buf = [0u8; 512];
        loop {
            let Ok(mut guard) = afd.readable().await else {
                return;
            };
            let read = guard.try_io(|fd| {
                // SAFETY: buf is valid for writes of buf.len() bytes.
                let n = unsafe {
                    libc::read(fd.get_ref().as_raw_fd(), buf.as_mut_ptr().cast(), buf.len())
                };
                if n < 0 {
                    Err(std::io::Error::last_os_error())
                } else {
                    Ok(n)
                }
            });
            match read {
                Ok(Ok(_)) => {
                    if !events.exists() {
                        return;
                    }
                    let now = oom_kills(&dir);
                    if now > seen {
                        seen = now;
                        on_oom();
                    }
                }
                Ok(Err(_)) => return,
                Err(_would_block) => continue,
            }
        }
    }))
}
