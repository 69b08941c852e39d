//! Generates Rust for the protobuf messages containerd sends the shim that
//! containerd-shim-protos does not carry (shim/proto/*.proto, each naming
//! the containerd schema it follows). protobuf-codegen's own parser reads
//! them, so no `protoc` is needed; the code lands in `OUT_DIR` and is
//! included by the module that decodes each message.

use protobuf_codegen::{Codegen, Customize};

/// One output directory per including module: `mod.rs` declares each
/// generated file as a submodule.
const GROUPS: &[(&str, &[&str])] = &[
    (
        "options_proto",
        &["proto/runctypes.proto", "proto/runtimeoptions.proto"],
    ),
    ("bootstrap_proto", &["proto/bootstrap.proto"]),
];

fn main() {
    for (dir, inputs) in GROUPS {
        for input in *inputs {
            println!("cargo:rerun-if-changed={input}");
        }
        Codegen::new()
            .pure()
            .include("proto")
            .inputs(*inputs)
            // Parsing and encoding only: no descriptors or reflection in
            // the binary.
            .customize(Customize::default().gen_mod_rs(true).lite_runtime(true))
            .cargo_out_dir(dir)
            .run_from_script();
    }
    println!("cargo:rerun-if-changed=build.rs");
}
