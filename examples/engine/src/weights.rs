//! Startup: the weights attached, through GMS when the pair has a host
//! daemon (the first engine writes and commits them, the others map the
//! committed bytes), else read privately; either way verified. And the
//! daemon's socket, where the engine asks for the KV pool once active.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::Duration;

use gms::client::{host_socket, Client, Imported, Weights};
use gms::protocol::{LeaseKind, Mode};
use shadow_contract::env;
use shadow_engine::model::verify;
use shadow_engine::{Error, Result};

/// Metadata key: bytes of the file inside the GMS allocation (it is rounded up).
pub const LEN_KEY: &str = "weights.len";

/// The GMS connection: held, never read, because closing it ends the lease.
pub struct Lease(#[allow(dead_code)] Client);

/// Where the weights live; each variant owns its memory (and lease).
pub enum Source {
    Private(Vec<u8>),
    // Field order: the mapping goes before the lease that granted it.
    GmsWriter(Weights, #[allow(dead_code)] Lease, usize),
    GmsReader(Imported, #[allow(dead_code)] Lease, usize),
}

impl Source {
    pub fn name(&self) -> &'static str {
        match self {
            Source::Private(_) => "file",
            Source::GmsWriter(..) => "gms-writer",
            Source::GmsReader(..) => "gms-reader",
        }
    }

    pub fn bytes(&self) -> &[u8] {
        match self {
            Source::Private(v) => v,
            Source::GmsWriter(w, _, len) => w.bytes().map(|b| &b[..*len]).unwrap_or(&[]),
            Source::GmsReader(imp, _, len) => imp
                .weights
                .iter()
                .find(|w| w.allocation().tag == "weights")
                .and_then(|w| w.bytes())
                .map(|b| &b[..(*len).min(b.len())])
                .unwrap_or(&[]),
        }
    }
}

fn io<'a>(what: &'static str, path: &'a Path) -> impl FnOnce(std::io::Error) -> Error + 'a {
    move |source| Error::Io {
        what,
        path: path.to_owned(),
        source,
    }
}

pub fn gms_err(what: &'static str) -> impl FnOnce(gms::Error) -> Error {
    move |source| Error::Gms { what, source }
}

/// Attach the weights: through GMS when its socket is there (which is
/// returned too), else privately.
pub fn attach(file: &Path, slot: &str) -> Result<(Source, Option<PathBuf>)> {
    let socket = std::env::var_os(env::GMS_SOCKET_DIR).map(|d| host_socket(Path::new(&d)));
    let Some(socket) = socket.filter(|s| s.exists()) else {
        let bytes = std::fs::read(file).map_err(io("read weights", file))?;
        verify(&bytes, file)?;
        return Ok((Source::Private(bytes), None));
    };
    let name = format!("shadow-engine-{slot}");
    let mut c = Client::connect_wait(&socket, Mode::RwOrRo, &name, Duration::from_secs(10))
        .map_err(gms_err("connect"))?;
    if c.lease() == LeaseKind::Rw {
        let mut f = std::fs::File::open(file).map_err(io("open weights", file))?;
        let len = f.metadata().map_err(io("stat weights", file))?.len() as usize;
        let mut w = c
            .allocate("weights", len as u64)
            .map_err(gms_err("allocate weights"))?;
        {
            let buf = w
                .bytes_mut()
                .ok_or_else(|| Error::Usage("GMS allocation is not mapped".into()))?;
            f.read_exact(&mut buf[..len])
                .map_err(io("read weights", file))?;
            verify(&buf[..len], file)?;
        }
        c.put_meta(LEN_KEY, &len.to_string())
            .map_err(gms_err("put_meta"))?;
        c.commit(std::slice::from_mut(&mut w))
            .map_err(gms_err("commit"))?;
        Ok((Source::GmsWriter(w, Lease(c), len), Some(socket)))
    } else {
        let imp = c.import().map_err(gms_err("import"))?;
        let len = c
            .get_meta(LEN_KEY)
            .map_err(gms_err("get_meta"))?
            .and_then(|v| v.parse().ok())
            .ok_or_else(|| {
                Error::Usage(format!(
                    "GMS layout has no {LEN_KEY}: not written by shadow-engine"
                ))
            })?;
        Ok((Source::GmsReader(imp, Lease(c), len), Some(socket)))
    }
}
