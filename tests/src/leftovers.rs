//! What a test may leave behind, how to find it, and how to remove it.
//!
//! Everything here is scoped to one private containerd: its temp dir, its
//! socket address, its namespace and the container ids it ran. Processes are
//! only ever signalled when their command line names our own temp dir, so
//! other people's containerds, shims and containers on the machine are safe.

use crate::wait;
use sha2::{Digest, Sha256};
use std::collections::BTreeSet;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// Where runc-v2 (and runc-based shims) keep runc state, per namespace.
pub const RUNC_STATE_ROOT: &str = "/run/containerd/runc";

/// Where containerd shims put their task sockets (shared by all containerds).
pub const SHIM_SOCKET_DIR: &str = "/run/containerd/s";

/// One thing left behind.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Leftover {
    /// A mount point under the test's dir.
    Mount { path: PathBuf },
    /// A runc container in the namespace's runc root.
    RuncContainer { root: PathBuf, id: String },
    /// A directory cleanup should have removed.
    Dir { path: PathBuf },
    /// A process naming our address or dir (a shim, a stray ctr).
    Process { pid: i32, cmdline: String },
    /// A listening Unix socket, or a socket file, of ours.
    Socket { path: PathBuf },
    /// A cgroup under the namespace's cgroup dir.
    Cgroup { path: PathBuf },
    /// A task containerd still lists.
    Task { id: String, status: String },
    /// A container containerd still lists.
    Container { id: String },
}

/// What to scan.
pub(crate) struct Scope<'a> {
    pub dir: &'a Path,
    pub address: &'a Path,
    pub namespace: &'a str,
    pub ids: &'a BTreeSet<String>,
    pub containerd_pid: Option<u32>,
    /// After cleanup the dirs themselves must be gone too.
    pub after_cleanup: bool,
}

pub(crate) fn scan(s: &Scope<'_>) -> Vec<Leftover> {
    let mut found = Vec::new();
    found.extend(
        mounts_under(s.dir)
            .into_iter()
            .map(|path| Leftover::Mount { path }),
    );
    let runc_root = Path::new(RUNC_STATE_ROOT).join(s.namespace);
    found.extend(
        runc_containers(&runc_root)
            .into_iter()
            .map(|id| Leftover::RuncContainer {
                root: runc_root.clone(),
                id,
            }),
    );
    for (pid, cmdline) in our_processes(s.dir, s.address) {
        if Some(pid as u32) != s.containerd_pid {
            found.push(Leftover::Process { pid, cmdline });
        }
    }
    // Sockets: any bound under our dir but containerd's own (while it runs),
    // and the shim sockets for our ids in the shared dir.
    let own: Vec<PathBuf> = if s.containerd_pid.is_some() {
        ["containerd.sock", "containerd.sock.ttrpc", "debug.sock"]
            .iter()
            .map(|n| s.dir.join(n))
            .collect()
    } else {
        Vec::new()
    };
    for path in bound_unix_sockets() {
        if path.starts_with(s.dir) && !own.contains(&path) {
            found.push(Leftover::Socket { path });
        }
    }
    for id in s.ids {
        for path in shim_socket_paths(s.address, s.namespace, id) {
            if path.exists() {
                found.push(Leftover::Socket { path });
            }
        }
    }
    for ns_dir in cgroup_dirs(s.namespace) {
        if s.after_cleanup {
            found.push(Leftover::Cgroup { path: ns_dir });
        } else {
            found.extend(
                subdirs(&ns_dir)
                    .into_iter()
                    .map(|path| Leftover::Cgroup { path }),
            );
        }
    }
    if s.after_cleanup {
        for d in [s.dir.to_owned(), runc_root] {
            if d.exists() {
                found.push(Leftover::Dir { path: d });
            }
        }
    }
    found
}

/// Mount points at or under `dir`, deepest first, from /proc/self/mountinfo.
pub fn mounts_under(dir: &Path) -> Vec<PathBuf> {
    let text = std::fs::read_to_string("/proc/self/mountinfo").unwrap_or_default();
    let mut v: Vec<PathBuf> = text
        .lines()
        .filter_map(|l| l.split(' ').nth(4))
        .map(|m| PathBuf::from(unescape_mountinfo(m)))
        .filter(|p| p.starts_with(dir))
        .collect();
    v.sort_by_key(|p| std::cmp::Reverse(p.components().count()));
    v.dedup();
    v
}

/// mountinfo escapes space, tab, newline and backslash as `\ooo`.
fn unescape_mountinfo(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'\\'
            && i + 4 <= b.len()
            && b[i + 1..i + 4].iter().all(|c| (b'0'..=b'7').contains(c))
        {
            if let Ok(n) = u8::from_str_radix(&s[i + 1..i + 4], 8) {
                out.push(n);
                i += 4;
                continue;
            }
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

pub(crate) fn unmount_under(dir: &Path) {
    for m in mounts_under(dir) {
        let _ = nix::mount::umount2(&m, nix::mount::MntFlags::MNT_DETACH);
    }
}

/// Container ids in a runc root (`runc --root … list -q`).
pub fn runc_containers(root: &Path) -> Vec<String> {
    if !root.is_dir() {
        return Vec::new();
    }
    let out = Command::new("runc")
        .arg("--root")
        .arg(root)
        .args(["list", "-q"])
        .output();
    match out {
        Ok(o) => String::from_utf8_lossy(&o.stdout)
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .map(str::to_owned)
            .collect(),
        Err(_) => Vec::new(),
    }
}

/// Processes whose command line names our dir or address, except ourselves.
pub fn our_processes(dir: &Path, address: &Path) -> Vec<(i32, String)> {
    let me = std::process::id() as i32;
    let dir = dir.display().to_string();
    let address = address.display().to_string();
    let mut v = Vec::new();
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return v;
    };
    for e in rd.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<i32>().ok()) else {
            continue;
        };
        if pid == me {
            continue;
        }
        let Ok(raw) = std::fs::read(e.path().join("cmdline")) else {
            continue;
        };
        let cmdline = String::from_utf8_lossy(&raw).replace('\0', " ");
        if cmdline.contains(&dir) || cmdline.contains(&address) {
            v.push((pid, cmdline.trim_end().to_owned()));
        }
    }
    v
}

/// SIGKILL every process naming our dir or address (our shims, a stray
/// `ctr` of ours) and wait until they are gone, at most `timeout`.
pub(crate) fn kill_our_processes(dir: &Path, address: &Path, timeout: Duration) {
    let _ = wait::within(timeout, Duration::from_millis(20), || {
        let procs = our_processes(dir, address);
        if procs.is_empty() {
            return Some(());
        }
        for (pid, _) in procs {
            kill_if_ours(pid, dir, address);
        }
        None
    });
}

/// SIGKILL `pid` if its command line still names our dir or address.
fn kill_if_ours(pid: i32, dir: &Path, address: &Path) {
    // Open a pidfd first, then re-check the command line, so a pid
    // recycled in between is never signalled.
    let Ok(fd) = gmsd_launch::pidfd::open(pid) else {
        return;
    };
    let still_ours = std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|raw| {
            let c = String::from_utf8_lossy(&raw).replace('\0', " ");
            c.contains(&*dir.to_string_lossy()) || c.contains(&*address.to_string_lossy())
        })
        .unwrap_or(false);
    if still_ours {
        // SAFETY: valid pidfd, signal number, null siginfo, no flags.
        unsafe {
            libc::syscall(
                libc::SYS_pidfd_send_signal,
                fd.as_raw_fd(),
                libc::SIGKILL,
                std::ptr::null::<libc::siginfo_t>(),
                0,
            );
        }
    }
}

/// Paths of bound Unix sockets, from /proc/net/unix.
fn bound_unix_sockets() -> Vec<PathBuf> {
    let text = std::fs::read_to_string("/proc/net/unix").unwrap_or_default();
    text.lines()
        .skip(1)
        .filter_map(|l| l.split_whitespace().nth(7))
        .filter(|p| p.starts_with('/'))
        .map(PathBuf::from)
        .collect()
}

/// Where a shim for (address, namespace, id) puts its task socket: both the
/// Go and the Rust shim kits hash `<address>/<namespace>/<id>` into
/// `/run/containerd/s/<sha256>`.
pub fn shim_socket_paths(address: &Path, namespace: &str, id: &str) -> Vec<PathBuf> {
    let addr = address.display().to_string();
    [addr.clone(), format!("unix://{addr}")]
        .iter()
        .map(|a| {
            let digest = Sha256::digest(format!("{a}/{namespace}/{id}").as_bytes());
            Path::new(SHIM_SOCKET_DIR).join(format!("{digest:x}"))
        })
        .collect()
}

/// `/sys/fs/cgroup/<controller>/<namespace>` dirs that exist (cgroup v1 and
/// v2 layouts alike: ctr puts a task in `/<namespace>/<id>`).
fn cgroup_dirs(namespace: &str) -> Vec<PathBuf> {
    let root = Path::new("/sys/fs/cgroup");
    let mut v = Vec::new();
    let direct = root.join(namespace);
    if direct.is_dir() {
        v.push(direct);
    }
    if let Ok(rd) = std::fs::read_dir(root) {
        for e in rd.flatten() {
            let p = e.path().join(namespace);
            if p.is_dir() {
                v.push(p);
            }
        }
    }
    v
}

fn subdirs(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .map(|rd| {
            rd.flatten()
                .map(|e| e.path())
                .filter(|p| p.is_dir())
                .collect()
        })
        .unwrap_or_default()
}

/// rmdir the namespace's cgroups, leaves first (a cgroup with live
/// processes refuses, which the leftover check then reports).
pub(crate) fn remove_cgroups(namespace: &str) {
    for ns_dir in cgroup_dirs(namespace) {
        for sub in subdirs(&ns_dir) {
            for subsub in subdirs(&sub) {
                let _ = std::fs::remove_dir(subsub);
            }
            let _ = std::fs::remove_dir(sub);
        }
        let _ = std::fs::remove_dir(ns_dir);
    }
}
