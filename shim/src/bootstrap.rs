//! containerd >= 2.3's bootstrap protocol for `start`
//! (`containerd.runtime.bootstrap.v1`): containerd writes one
//! `BootstrapParams` message on stdin and expects a `BootstrapResult` on
//! stdout instead of a bare address. Older containerd writes the runtime
//! options `Any` (or nothing) and expects the bare address.
//!
//! A tiny wire-level codec, because the messages are not in
//! containerd-shim-protos 0.11. Protobuf ignores unknown fields, so an `Any`
//! can decode as `BootstrapParams` by accident: as containerd's own shim
//! library does, we only believe it is one when its instance id and namespace
//! equal our command-line flags.

use containerd_shim_protos::protobuf::{well_known_types::any::Any, CodedInputStream, Message};
use protobuf::{rt::WireType, CodedOutputStream};

use crate::error::{Error, Result};
use crate::options::{split_tag, RuntimeOptions};

/// The fields of `BootstrapParams` the shim uses.
#[derive(Debug, Default, Clone, PartialEq)]
pub struct BootstrapParams {
    pub instance_id: String,
    pub namespace: String,
    pub log_level: i32,
    pub containerd_version: String,
    pub containerd_ttrpc_address: String,
    pub containerd_grpc_address: String,
    pub containerd_binary: String,
    /// `Extension.value` of each extension, in order.
    pub extensions: Vec<Any>,
}

/// What `start` found on stdin.
#[derive(Debug, Clone, PartialEq)]
pub enum StartInput {
    /// containerd 1.6/1.7/2.0-2.2: runtime options only; reply with the address.
    Legacy(RuntimeOptions),
    /// containerd >= 2.3: reply with an encoded `BootstrapResult`.
    Bootstrap(Box<BootstrapParams>, RuntimeOptions),
}

impl StartInput {
    pub fn parse(stdin: &[u8], id: &str, namespace: &str) -> Result<Self> {
        if !stdin.is_empty() {
            if let Ok(params) = BootstrapParams::decode(stdin) {
                if params.instance_id == id && params.namespace == namespace {
                    let mut opts = RuntimeOptions::default();
                    // The runtime options travel as one of the extensions.
                    for ext in &params.extensions {
                        let o = RuntimeOptions::from_any(ext)?;
                        if o != RuntimeOptions::default() {
                            opts = o;
                        }
                    }
                    return Ok(StartInput::Bootstrap(Box::new(params), opts));
                }
            }
        }
        Ok(StartInput::Legacy(RuntimeOptions::from_any_bytes(stdin)?))
    }

    pub fn options(&self) -> &RuntimeOptions {
        match self {
            StartInput::Legacy(o) | StartInput::Bootstrap(_, o) => o,
        }
    }

    /// The bytes to write on stdout for this kind of caller.
    pub fn reply(&self, address: &str) -> Result<Vec<u8>> {
        match self {
            StartInput::Legacy(_) => Ok(address.as_bytes().to_vec()),
            StartInput::Bootstrap(..) => encode_result(address),
        }
    }
}

impl BootstrapParams {
    pub fn decode(bytes: &[u8]) -> Result<Self> {
        let err = |reason: String| Error::Decode {
            what: "BootstrapParams",
            reason,
        };
        let mut p = BootstrapParams::default();
        let mut is = CodedInputStream::from_bytes(bytes);
        while let Some(tag) = is.read_raw_tag_or_eof().map_err(|e| err(e.to_string()))? {
            let (field, wire) = split_tag(tag).ok_or_else(|| err(format!("bad tag {tag}")))?;
            let text = |is: &mut CodedInputStream| -> Result<String> {
                is.read_string().map_err(|e| err(e.to_string()))
            };
            match (field, wire) {
                (1, WireType::LengthDelimited) => p.instance_id = text(&mut is)?,
                (2, WireType::LengthDelimited) => p.namespace = text(&mut is)?,
                (3, WireType::Varint) => {
                    p.log_level = is.read_int32().map_err(|e| err(e.to_string()))?
                }
                (4, WireType::LengthDelimited) => p.containerd_version = text(&mut is)?,
                (5, WireType::LengthDelimited) => p.containerd_ttrpc_address = text(&mut is)?,
                (6, WireType::LengthDelimited) => p.containerd_grpc_address = text(&mut is)?,
                (7, WireType::LengthDelimited) => p.containerd_binary = text(&mut is)?,
                (8, WireType::LengthDelimited) => {
                    let ext = is.read_bytes().map_err(|e| err(e.to_string()))?;
                    p.extensions.push(decode_extension(&ext)?);
                }
                (_, wire) => is.skip_field(wire).map_err(|e| err(e.to_string()))?,
            }
        }
        Ok(p)
    }
}

/// `Extension { google.protobuf.Any value = 1; }`
fn decode_extension(bytes: &[u8]) -> Result<Any> {
    let err = |reason: String| Error::Decode {
        what: "BootstrapParams.extensions",
        reason,
    };
    let mut any = Any::default();
    let mut is = CodedInputStream::from_bytes(bytes);
    while let Some(tag) = is.read_raw_tag_or_eof().map_err(|e| err(e.to_string()))? {
        let (field, wire) = split_tag(tag).ok_or_else(|| err(format!("bad tag {tag}")))?;
        if field == 1 && wire == WireType::LengthDelimited {
            let raw = is.read_bytes().map_err(|e| err(e.to_string()))?;
            any = Any::parse_from_bytes(&raw).map_err(|e| err(e.to_string()))?;
        } else {
            is.skip_field(wire).map_err(|e| err(e.to_string()))?;
        }
    }
    Ok(any)
}

/// `BootstrapResult { int32 version = 1; string address = 2; string protocol = 3; }`
pub fn encode_result(address: &str) -> Result<Vec<u8>> {
    let err = |e: protobuf::Error| Error::Decode {
        what: "BootstrapResult (encoding)",
        reason: e.to_string(),
    };
    let mut out = Vec::new();
    {
        let mut os = CodedOutputStream::vec(&mut out);
        os.write_int32(1, 2).map_err(err)?;
        os.write_string(2, address).map_err(err)?;
        os.write_string(3, "ttrpc").map_err(err)?;
        os.flush().map_err(err)?;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::options::tests::runtimeoptions_any;
    use std::path::PathBuf;

    /// Encode params the way containerd 2.3 does (field numbers from
    /// api/runtime/bootstrap/v1/bootstrap.proto).
    fn encode_params(id: &str, ns: &str, exts: &[Any]) -> Vec<u8> {
        let mut out = Vec::new();
        let mut os = CodedOutputStream::vec(&mut out);
        os.write_string(1, id).unwrap();
        os.write_string(2, ns).unwrap();
        os.write_int32(3, -4).unwrap();
        os.write_string(4, "2.3.0").unwrap();
        os.write_string(5, "/run/containerd/containerd.sock.ttrpc")
            .unwrap();
        os.write_string(6, "/run/containerd/containerd.sock")
            .unwrap();
        os.write_string(7, "/usr/bin/containerd").unwrap();
        for e in exts {
            let any = e.write_to_bytes().unwrap();
            let mut ext = Vec::new();
            {
                let mut eo = CodedOutputStream::vec(&mut ext);
                eo.write_bytes(1, &any).unwrap();
                eo.flush().unwrap();
            }
            os.write_bytes(8, &ext).unwrap();
        }
        // A field from a future version must be skipped, not fatal.
        os.write_string(9, "/run/containerd/s").unwrap();
        os.write_uint64(42, 7).unwrap();
        os.flush().unwrap();
        drop(os);
        out
    }

    #[test]
    fn recognises_bootstrap_params_and_their_runtime_options() {
        let bytes = encode_params("c1", "default", &[runtimeoptions_any("/etc/x.toml", "")]);
        let input = StartInput::parse(&bytes, "c1", "default").unwrap();
        let StartInput::Bootstrap(p, o) = &input else {
            panic!("not bootstrap: {input:?}")
        };
        assert_eq!(p.log_level, -4);
        assert_eq!(
            p.containerd_ttrpc_address,
            "/run/containerd/containerd.sock.ttrpc"
        );
        assert_eq!(p.extensions.len(), 1);
        assert_eq!(o.config.path, Some(PathBuf::from("/etc/x.toml")));
    }

    #[test]
    fn params_for_another_instance_are_not_bootstrap() {
        let bytes = encode_params("other", "default", &[]);
        // Not ours: then it must parse as legacy options, which this is not
        // (an Any with an unknown type is tolerated).
        let input = StartInput::parse(&bytes, "c1", "default").unwrap();
        assert!(matches!(input, StartInput::Legacy(_)));
    }

    #[test]
    fn legacy_any_and_empty_stdin_are_legacy() {
        let any = runtimeoptions_any("", "log_level = \"debug\"");
        let input = StartInput::parse(&any.write_to_bytes().unwrap(), "c1", "default").unwrap();
        let StartInput::Legacy(o) = &input else {
            panic!("{input:?}")
        };
        assert_eq!(o.config.body.as_deref(), Some("log_level = \"debug\""));
        assert_eq!(
            input.reply("unix:///run/containerd/s/ab").unwrap(),
            b"unix:///run/containerd/s/ab"
        );
        assert!(matches!(
            StartInput::parse(&[], "c1", "default").unwrap(),
            StartInput::Legacy(_)
        ));
    }

    #[test]
    fn bootstrap_reply_is_a_bootstrap_result() {
        let bytes = encode_params("c1", "ns", &[]);
        let input = StartInput::parse(&bytes, "c1", "ns").unwrap();
        let reply = input.reply("unix:///run/containerd/s/ab").unwrap();
        let mut is = CodedInputStream::from_bytes(&reply);
        let mut seen = (0, String::new(), String::new());
        while let Some(tag) = is.read_raw_tag_or_eof().unwrap() {
            match tag >> 3 {
                1 => seen.0 = is.read_int32().unwrap(),
                2 => seen.1 = is.read_string().unwrap(),
                3 => seen.2 = is.read_string().unwrap(),
                n => panic!("unexpected field {n}"),
            }
        }
        assert_eq!(
            seen,
            (2, "unix:///run/containerd/s/ab".into(), "ttrpc".into())
        );
    }

    #[test]
    fn truncated_params_fall_back_and_fail_cleanly() {
        let bytes = encode_params("c1", "ns", &[]);
        assert!(BootstrapParams::decode(&bytes[..5]).is_err());
    }
}
