//! Runtime options containerd hands the shim (stdin at `start`, or the
//! `options` field of Create): an `Any` that is one of
//! - runc-v2's own `containerd.runc.v1.Options` (what containerd's Go
//!   client sends to a runtime named `io.containerd.runc*`, and what the
//!   2.x client's `WithShimCgroup`, `WithNoNewKeyring`, `WithUIDOwner`…
//!   send to any runtime);
//! - the v1 runc types `containerd.linux.runc.CreateOptions` (what the 1.x
//!   client sends for those to any other runtime name, so to ours) and
//!   `containerd.linux.runc.RuncOptions`;
//! - the generic `runtimeoptions.v1.Options{type_url, config_path,
//!   config_body}` that containerd uses for runtimes it does not know
//!   (`ctr run --runtime-config-path`, a CRI entry's `ConfigPath`). The
//!   2.1+ client cannot add a task option of the kind above to these: a
//!   uid mapping with `--runtime-config-path` fails in ctr before the shim
//!   is asked (docs/operator-ctr.md).
//!
//! Only the first is in containerd-shim-protos; the others are decoded here
//! at the wire level.

use containerd_shim_protos::{
    protobuf::{well_known_types::any::Any, CodedInputStream, Message},
    shim::oci::Options as RuncV2Options,
};
use protobuf::rt::WireType;
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

use crate::config::ConfigSource;
use crate::error::{Error, Result};

/// What the shim takes from the runtime options.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct RuntimeOptions {
    pub config: ConfigSource,
    /// `ShimCgroup` from runc options: the cgroup the shim daemon joins.
    pub shim_cgroup: Option<String>,
    /// How runc is run for the task, as runc-v2 takes it from its options.
    pub runc: RuncOptions,
}

/// The runc settings a task's options may carry; each one overrides the
/// shim config for that task only, as in runc-v2.
#[derive(Debug, Default, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RuncOptions {
    /// `BinaryName` (v2) / `Runtime` (v1): the runc binary.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub binary: Option<String>,
    /// `Root` (v2) / `RuntimeRoot` (v1): parent of runc's per-namespace
    /// state roots.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub root: Option<PathBuf>,
    /// `SystemdCgroup`: `runc --systemd-cgroup`.
    #[serde(default)]
    pub systemd_cgroup: bool,
    /// `NoPivotRoot`: `runc create --no-pivot`.
    #[serde(default)]
    pub no_pivot_root: bool,
    /// `NoNewKeyring`: `runc create --no-new-keyring`.
    #[serde(default)]
    pub no_new_keyring: bool,
    /// `IoUid`/`IoGid`: owner of the container's ends of its stdio pipes,
    /// so that a process in a user namespace may reopen them.
    #[serde(default)]
    pub io_uid: u32,
    #[serde(default)]
    pub io_gid: u32,
}

/// Where Create leaves a task's runc options in its bundle, for the
/// `delete` action (containerd runs it without options, as runc-v2 reads
/// its `options.json`).
pub const BUNDLE_RUNC_OPTIONS: &str = "shadow-runc.json";

impl RuncOptions {
    /// Save to the bundle for the `delete` action; nothing when default.
    pub fn save(&self, bundle: &Path) -> Result<()> {
        let path = bundle.join(BUNDLE_RUNC_OPTIONS);
        if *self == RuncOptions::default() {
            return Ok(());
        }
        let bytes = serde_json::to_vec(self).map_err(|e| Error::Internal {
            what: path.display().to_string(),
            reason: e.to_string(),
        })?;
        std::fs::write(&path, bytes)
            .map_err(|e| Error::io(format!("writing {}", path.display()), e))
    }

    /// What Create saved in `bundle`, or the defaults.
    pub fn load(bundle: &Path) -> Result<Self> {
        let path = bundle.join(BUNDLE_RUNC_OPTIONS);
        match std::fs::read(&path) {
            Ok(bytes) => serde_json::from_slice(&bytes).map_err(|e| Error::Internal {
                what: path.display().to_string(),
                reason: e.to_string(),
            }),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(RuncOptions::default()),
            Err(e) => Err(Error::io(format!("reading {}", path.display()), e)),
        }
    }
}

/// One field of a protobuf message at the wire level.
enum WireValue {
    Varint(u64),
    Bytes(Vec<u8>),
}

/// Every varint and length-delimited field of a message; other wire types
/// are skipped.
fn wire_fields(bytes: &[u8], what: &'static str) -> Result<Vec<(u32, WireValue)>> {
    let err = |reason: String| Error::Decode { what, reason };
    let mut out = Vec::new();
    let mut is = CodedInputStream::from_bytes(bytes);
    while let Some(tag) = is.read_raw_tag_or_eof().map_err(|e| err(e.to_string()))? {
        let (field, wire) = split_tag(tag).ok_or_else(|| err(format!("bad tag {tag}")))?;
        match wire {
            WireType::Varint => {
                let v = is.read_raw_varint64().map_err(|e| err(e.to_string()))?;
                out.push((field, WireValue::Varint(v)));
            }
            WireType::LengthDelimited => {
                let raw = is.read_bytes().map_err(|e| err(e.to_string()))?;
                out.push((field, WireValue::Bytes(raw)));
            }
            _ => is.skip_field(wire).map_err(|e| err(e.to_string()))?,
        }
    }
    Ok(out)
}

/// A string field's text, or a decode error naming the field.
fn text(what: &'static str, field: u32, raw: Vec<u8>) -> Result<String> {
    String::from_utf8(raw).map_err(|_| Error::Decode {
        what,
        reason: format!("field {field} is not UTF-8"),
    })
}

fn non_empty(s: String) -> Option<String> {
    Some(s).filter(|s| !s.is_empty())
}

/// `containerd.linux.runc.CreateOptions` (runtime/linux/runctypes):
/// no_pivot_root = 1, no_new_keyring = 8, shim_cgroup = 9, io_uid = 10,
/// io_gid = 11. The rest (open_tcp, terminal, empty_namespaces,
/// cgroups_mode, criu paths) are checkpoint/restore settings, unused here.
fn from_runctypes_create(bytes: &[u8]) -> Result<RuntimeOptions> {
    const WHAT: &str = "containerd.linux.runc.CreateOptions";
    let mut out = RuntimeOptions::default();
    for (field, value) in wire_fields(bytes, WHAT)? {
        match (field, value) {
            (1, WireValue::Varint(v)) => out.runc.no_pivot_root = v != 0,
            (8, WireValue::Varint(v)) => out.runc.no_new_keyring = v != 0,
            (9, WireValue::Bytes(raw)) => out.shim_cgroup = non_empty(text(WHAT, 9, raw)?),
            (10, WireValue::Varint(v)) => out.runc.io_uid = v as u32,
            (11, WireValue::Varint(v)) => out.runc.io_gid = v as u32,
            _ => {}
        }
    }
    Ok(out)
}

/// `containerd.linux.runc.RuncOptions`: runtime = 1, runtime_root = 2,
/// criu_path = 3 (unused: no checkpoint), systemd_cgroup = 4.
fn from_runctypes_runc(bytes: &[u8]) -> Result<RuntimeOptions> {
    const WHAT: &str = "containerd.linux.runc.RuncOptions";
    let mut out = RuntimeOptions::default();
    for (field, value) in wire_fields(bytes, WHAT)? {
        match (field, value) {
            (1, WireValue::Bytes(raw)) => out.runc.binary = non_empty(text(WHAT, 1, raw)?),
            (2, WireValue::Bytes(raw)) => {
                out.runc.root = non_empty(text(WHAT, 2, raw)?).map(PathBuf::from)
            }
            (4, WireValue::Varint(v)) => out.runc.systemd_cgroup = v != 0,
            _ => {}
        }
    }
    Ok(out)
}

impl RuntimeOptions {
    /// Decode an `Any`; unknown option types are ignored (as runc-v2 does).
    pub fn from_any(any: &Any) -> Result<Self> {
        let name = any.type_url.rsplit('/').next().unwrap_or_default();
        match name {
            "runtimeoptions.v1.Options" => {
                let mut out = RuntimeOptions::default();
                for (field, value) in string_fields(&any.value, "runtimeoptions.v1.Options")? {
                    match field {
                        2 if !value.is_empty() => out.config.path = Some(PathBuf::from(value)),
                        3 if !value.is_empty() => out.config.body = Some(value),
                        _ => {}
                    }
                }
                Ok(out)
            }
            "containerd.runc.v1.Options" => {
                let o = RuncV2Options::parse_from_bytes(&any.value).map_err(|e| Error::Decode {
                    what: "containerd.runc.v1.Options",
                    reason: e.to_string(),
                })?;
                Ok(RuntimeOptions {
                    config: ConfigSource::default(),
                    shim_cgroup: non_empty(o.shim_cgroup),
                    runc: RuncOptions {
                        binary: non_empty(o.binary_name),
                        root: non_empty(o.root).map(PathBuf::from),
                        systemd_cgroup: o.systemd_cgroup,
                        no_pivot_root: o.no_pivot_root,
                        no_new_keyring: o.no_new_keyring,
                        io_uid: o.io_uid,
                        io_gid: o.io_gid,
                    },
                })
            }
            "containerd.linux.runc.CreateOptions" => from_runctypes_create(&any.value),
            "containerd.linux.runc.RuncOptions" => from_runctypes_runc(&any.value),
            _ => Ok(RuntimeOptions::default()),
        }
    }

    /// Decode the bytes containerd 1.6/1.7 write on `start`'s stdin: an
    /// encoded `Any`, or nothing at all.
    pub fn from_any_bytes(bytes: &[u8]) -> Result<Self> {
        if bytes.is_empty() {
            return Ok(RuntimeOptions::default());
        }
        let any = Any::parse_from_bytes(bytes).map_err(|e| Error::Decode {
            what: "runtime options on stdin",
            reason: e.to_string(),
        })?;
        Self::from_any(&any)
    }
}

/// Every length-delimited field of a message, as (field number, UTF-8 text);
/// other wire types are skipped.
pub(crate) fn string_fields(bytes: &[u8], what: &'static str) -> Result<Vec<(u32, String)>> {
    let err = |reason: String| Error::Decode { what, reason };
    let mut out = Vec::new();
    let mut is = CodedInputStream::from_bytes(bytes);
    while let Some(tag) = is.read_raw_tag_or_eof().map_err(|e| err(e.to_string()))? {
        let (field, wire) = split_tag(tag).ok_or_else(|| err(format!("bad tag {tag}")))?;
        if wire == WireType::LengthDelimited {
            let raw = is.read_bytes().map_err(|e| err(e.to_string()))?;
            let text =
                String::from_utf8(raw).map_err(|_| err(format!("field {field} is not UTF-8")))?;
            out.push((field, text));
        } else {
            is.skip_field(wire).map_err(|e| err(e.to_string()))?;
        }
    }
    Ok(out)
}

pub(crate) fn split_tag(tag: u32) -> Option<(u32, WireType)> {
    let field = tag >> 3;
    if field == 0 {
        return None;
    }
    WireType::new(tag & 7).map(|w| (field, w))
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use protobuf::CodedOutputStream;

    pub fn runtimeoptions_any(path: &str, body: &str) -> Any {
        let mut value = Vec::new();
        {
            let mut os = CodedOutputStream::vec(&mut value);
            os.write_string(1, "io.containerd.shadow.v1.Config")
                .unwrap();
            os.write_string(2, path).unwrap();
            os.write_string(3, body).unwrap();
            os.flush().unwrap();
        }
        Any {
            type_url: "runtimeoptions.v1.Options".into(),
            value,
            ..Default::default()
        }
    }

    #[test]
    fn decodes_generic_runtime_options() {
        let any = runtimeoptions_any("/etc/shadow/alt.toml", "");
        let o = RuntimeOptions::from_any_bytes(&any.write_to_bytes().unwrap()).unwrap();
        assert_eq!(o.config.path, Some(PathBuf::from("/etc/shadow/alt.toml")));
        assert_eq!(o.config.body, None);
    }

    #[test]
    fn decodes_runc_options() {
        let mut ro = RuncV2Options::new();
        ro.shim_cgroup = "/pods/x".into();
        ro.root = "/tmp/runc-test".into();
        ro.binary_name = "/usr/local/bin/runc".into();
        ro.systemd_cgroup = true;
        ro.no_pivot_root = true;
        ro.no_new_keyring = true;
        ro.io_uid = 1000;
        ro.io_gid = 2000;
        let any = Any {
            type_url: "containerd.runc.v1.Options".into(),
            value: ro.write_to_bytes().unwrap(),
            ..Default::default()
        };
        let o = RuntimeOptions::from_any(&any).unwrap();
        assert_eq!(o.shim_cgroup.as_deref(), Some("/pods/x"));
        assert_eq!(
            o.runc,
            RuncOptions {
                binary: Some("/usr/local/bin/runc".into()),
                root: Some("/tmp/runc-test".into()),
                systemd_cgroup: true,
                no_pivot_root: true,
                no_new_keyring: true,
                io_uid: 1000,
                io_gid: 2000,
            }
        );
    }

    /// `runctypes.CreateOptions` as Go's client encodes it for a runtime
    /// whose name is not `io.containerd.runc*` (field numbers from
    /// containerd's runtime/linux/runctypes/runc.proto).
    #[test]
    fn decodes_v1_runctypes_create_options() {
        let mut value = Vec::new();
        {
            let mut os = CodedOutputStream::vec(&mut value);
            os.write_bool(1, true).unwrap(); // no_pivot_root
            os.write_bool(2, true).unwrap(); // open_tcp: ignored
            os.write_string(6, "network").unwrap(); // empty_namespaces: ignored
            os.write_bool(8, true).unwrap(); // no_new_keyring
            os.write_string(9, "/containerd/shim").unwrap();
            os.write_uint32(10, 1000).unwrap();
            os.write_uint32(11, 2000).unwrap();
            os.write_string(13, "/ckpt").unwrap(); // criu_image_path: ignored
            os.flush().unwrap();
        }
        let any = Any {
            type_url: "containerd.linux.runc.CreateOptions".into(),
            value,
            ..Default::default()
        };
        let o = RuntimeOptions::from_any_bytes(&any.write_to_bytes().unwrap()).unwrap();
        assert_eq!(o.shim_cgroup.as_deref(), Some("/containerd/shim"));
        assert_eq!(
            o.runc,
            RuncOptions {
                no_pivot_root: true,
                no_new_keyring: true,
                io_uid: 1000,
                io_gid: 2000,
                ..Default::default()
            }
        );
        // A wrongly typed field is a decode error, not silently ignored.
        let any = Any {
            type_url: "containerd.linux.runc.CreateOptions".into(),
            value: vec![0x4a, 0x02, 0xff, 0xfe], // field 9, bytes, not UTF-8
            ..Default::default()
        };
        assert!(RuntimeOptions::from_any(&any).is_err());
    }

    #[test]
    fn decodes_v1_runctypes_runc_options() {
        let mut value = Vec::new();
        {
            let mut os = CodedOutputStream::vec(&mut value);
            os.write_string(1, "crun").unwrap();
            os.write_string(2, "/run/other").unwrap();
            os.write_string(3, "/usr/sbin/criu").unwrap();
            os.write_bool(4, true).unwrap();
            os.flush().unwrap();
        }
        let any = Any {
            type_url: "type.googleapis.com/containerd.linux.runc.RuncOptions".into(),
            value,
            ..Default::default()
        };
        let o = RuntimeOptions::from_any(&any).unwrap();
        assert_eq!(
            o.runc,
            RuncOptions {
                binary: Some("crun".into()),
                root: Some("/run/other".into()),
                systemd_cgroup: true,
                ..Default::default()
            }
        );
    }

    #[test]
    fn runc_options_round_trip_through_the_bundle() {
        let d = tempfile::tempdir().unwrap();
        assert_eq!(RuncOptions::load(d.path()).unwrap(), RuncOptions::default());
        RuncOptions::default().save(d.path()).unwrap();
        assert!(!d.path().join(BUNDLE_RUNC_OPTIONS).exists());
        let o = RuncOptions {
            root: Some("/tmp/runc-test".into()),
            io_uid: 7,
            ..Default::default()
        };
        o.save(d.path()).unwrap();
        assert_eq!(RuncOptions::load(d.path()).unwrap(), o);
    }

    #[test]
    fn empty_stdin_and_unknown_types_mean_defaults() {
        assert_eq!(
            RuntimeOptions::from_any_bytes(&[]).unwrap(),
            RuntimeOptions::default()
        );
        let any = Any {
            type_url: "example.com/other".into(),
            value: vec![1, 2, 3],
            ..Default::default()
        };
        assert_eq!(
            RuntimeOptions::from_any(&any).unwrap(),
            RuntimeOptions::default()
        );
    }

    #[test]
    fn garbage_is_a_decode_error() {
        assert!(RuntimeOptions::from_any_bytes(&[0xff, 0xff, 0xff]).is_err());
    }
}
