//! Runtime options containerd hands the shim (stdin at `start`, or the
//! `options` field of Create): an `Any` that is either runc's own
//! `containerd.runc.v1.Options` or the generic
//! `runtimeoptions.v1.Options{type_url, config_path, config_body}` that
//! containerd uses for runtimes it does not know. The generic message is not
//! in containerd-shim-protos, so it is decoded here at the wire level.

use containerd_shim_protos::{
    protobuf::{well_known_types::any::Any, CodedInputStream, Message},
    shim::oci::Options as RuncOptions,
};
use protobuf::rt::WireType;
use std::path::PathBuf;

use crate::config::ConfigSource;
use crate::error::{Error, Result};

/// What the shim takes from the runtime options.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct RuntimeOptions {
    pub config: ConfigSource,
    /// `ShimCgroup` from runc options: the cgroup the shim daemon joins.
    pub shim_cgroup: Option<String>,
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
                let o = RuncOptions::parse_from_bytes(&any.value).map_err(|e| Error::Decode {
                    what: "containerd.runc.v1.Options",
                    reason: e.to_string(),
                })?;
                Ok(RuntimeOptions {
                    config: ConfigSource::default(),
                    shim_cgroup: Some(o.shim_cgroup).filter(|s| !s.is_empty()),
                })
            }
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
    fn decodes_runc_options_shim_cgroup() {
        let mut ro = RuncOptions::new();
        ro.shim_cgroup = "/pods/x".into();
        let any = Any {
            type_url: "containerd.runc.v1.Options".into(),
            value: ro.write_to_bytes().unwrap(),
            ..Default::default()
        };
        let o = RuntimeOptions::from_any(&any).unwrap();
        assert_eq!(o.shim_cgroup.as_deref(), Some("/pods/x"));
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
