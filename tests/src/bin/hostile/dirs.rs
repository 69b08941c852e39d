//! `dirs`: write into every directory and file the runtime provides, then
//! park as a well-formed shadow.
//!
//! For each of the lock's directory, the notify socket's directory and
//! `GMS_SOCKET_DIR`: create a file and fill it (`--fill-mib N`, default 1;
//! the host's `/run` is a tmpfs), and make a directory. Then write into
//! the lock file, and take the place of every socket: unlink it and make a
//! directory there (so a gmsd started later cannot bind), or bind a server
//! of our own there. Each try prints `step=wrote:<what>` or
//! `step=refused:<what>`; none of them may change anything on the host.
//! The test looks at the host directories from outside.

use std::io::Write;
use std::os::unix::net::{UnixDatagram, UnixListener};
use std::path::{Path, PathBuf};

use shadow_contract::env;

use crate::common::{park_forever, step};

const NAME: &str = "dirs";

fn report(what: &str, r: std::io::Result<()>) {
    match r {
        Ok(()) => step(NAME, &format!("wrote:{what}")),
        Err(e) => step(NAME, &format!("refused:{what}:{}", e.kind())),
    }
}

fn fill(path: &Path, mib: usize) -> std::io::Result<()> {
    let mut f = std::fs::File::create(path)?;
    let chunk = vec![0x5au8; 1 << 20];
    for _ in 0..mib {
        f.write_all(&chunk)?;
    }
    f.sync_all()
}

/// Take the place of the socket at `path`: a directory, so nothing can
/// bind there again, else a listener of our own.
fn squat(path: &Path) {
    let shown = path.display();
    report(
        &format!("unlink {shown}"),
        std::fs::remove_file(path).or_else(|_| std::fs::remove_dir_all(path)),
    );
    report(&format!("mkdir {shown}"), std::fs::create_dir(path));
    let _ = std::fs::remove_dir(path);
    // Kept open for the life of the engine: a server of ours.
    match UnixListener::bind(path) {
        Ok(l) => {
            std::mem::forget(l);
            step(NAME, &format!("wrote:bind {shown}"));
        }
        Err(e) => step(NAME, &format!("refused:bind {shown}:{}", e.kind())),
    }
}

pub fn run(args: &[String]) -> Result<(), String> {
    let mib = match args {
        [flag, n] if flag == "--fill-mib" => n.parse().map_err(|e| format!("--fill-mib: {e}"))?,
        [] => 1,
        _ => return Err("usage: dirs [--fill-mib N]".into()),
    };
    let var = |name: &str| std::env::var(name).map_err(|_| format!("{name} is not set"));
    let lock = PathBuf::from(var(env::LOCK_PATH)?);
    let notify = PathBuf::from(var(env::NOTIFY_SOCKET)?);
    let gms_dir = std::env::var(env::GMS_SOCKET_DIR).ok().map(PathBuf::from);
    let mut dirs: Vec<PathBuf> = [&lock, &notify]
        .iter()
        .filter_map(|p| p.parent().map(Path::to_path_buf))
        .chain(gms_dir.clone())
        .collect();
    dirs.dedup();
    for (i, d) in dirs.iter().enumerate() {
        let file = d.join(format!("hostile-{i}"));
        report(&format!("fill {}", file.display()), fill(&file, mib));
        let sub = d.join(format!("hostile-dir-{i}"));
        report(
            &format!("mkdir {}", sub.display()),
            std::fs::create_dir(&sub),
        );
    }
    report(
        &format!("write {}", lock.display()),
        std::fs::OpenOptions::new()
            .write(true)
            .open(&lock)
            .and_then(|mut f| f.write_all(b"hostile")),
    );
    // The notify socket: replaced by a datagram socket of ours, the shim
    // would hear nothing more from either engine.
    report(
        &format!("unlink {}", notify.display()),
        std::fs::remove_file(&notify),
    );
    match UnixDatagram::bind(&notify) {
        Ok(s) => {
            std::mem::forget(s);
            step(NAME, &format!("wrote:bind {}", notify.display()));
        }
        Err(e) => step(
            NAME,
            &format!("refused:bind {}:{}", notify.display(), e.kind()),
        ),
    }
    if let Some(gms_dir) = gms_dir {
        let sockets: Vec<PathBuf> = std::fs::read_dir(&gms_dir)
            .map_err(|e| format!("listing {}: {e}", gms_dir.display()))?
            .filter_map(|e| e.ok().map(|e| e.path()))
            .filter(|p| {
                p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(shadow_contract::paths::is_gms_socket_name)
            })
            .collect();
        step(NAME, &format!("gms-sockets={}", sockets.len()));
        for s in &sockets {
            squat(s);
        }
        // A socket name gmsd has not used yet (another device).
        squat(&gms_dir.join("gms-GPU-00000000-0000-0000-0000-000000000000.sock"));
    }
    step(NAME, "attacked");
    park_forever(&[])
}
