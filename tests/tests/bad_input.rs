//! Bad input gets a clear error and leaves nothing behind: a missing rootfs,
//! a config that does not parse, a spec the runtime must refuse, a binary
//! the container does not have, and (our shim only) an annotation value it
//! does not know.

use shadow_tests::{Containerd, Output, Runtime};

/// A failed `ctr run --rm` must say why on stderr, and containerd must hold
/// no record of the container afterwards.
#[track_caller]
fn assert_refused(cd: &Containerd, out: &Output, needles: &[&str]) {
    assert_ne!(out.code(), 0, "expected an error: {out}");
    for n in needles {
        assert!(out.stderr.contains(n), "error should mention {n:?}: {out}");
    }
    assert_eq!(
        cd.ctr().containers().expect("containers ls"),
        Vec::<String>::new()
    );
    cd.assert_no_leftovers();
}

fn missing_rootfs(rt: Runtime) {
    let cd = Containerd::start().expect("start containerd");
    let missing = cd.dir().join("no-such-rootfs");
    let out = cd
        .container(rt, "norootfs")
        .rm()
        .rootfs(&missing)
        .cmd(&["true"])
        .run()
        .expect("ctr run");
    assert_refused(&cd, &out, &[&missing.display().to_string()]);
}

fn missing_binary(rt: Runtime) {
    let cd = Containerd::start().expect("start containerd");
    let out = cd
        .container(rt, "nobin")
        .rm()
        .cmd(&["/bin/no-such-program", "arg"])
        .run()
        .expect("ctr run");
    assert_refused(&cd, &out, &["/bin/no-such-program"]);
}

/// ctr decodes `--config` itself, so bytes that are not JSON stop there,
/// before containerd or a shim: still a clear error and nothing behind.
fn unparsable_config(rt: Runtime) {
    let cd = Containerd::start().expect("start containerd");
    let bad = cd.dir().join("config.json");
    std::fs::write(&bad, "{\"ociVersion\": \"1.0.2\", \"process\": {oops").expect("write config");
    let mut args = cd.container(rt, "badjson").rm().args().expect("args");
    // `--config` replaces rootfs and command: only the id stays positional.
    let rootfs_at = args
        .iter()
        .position(|a| a == "--rootfs")
        .expect("--rootfs in args");
    args.truncate(rootfs_at);
    args.extend([
        "--config".into(),
        bad.display().to_string(),
        "badjson".into(),
    ]);
    let out = cd.ctr().run(&args).expect("ctr run");
    assert_refused(&cd, &out, &["spec config file", "invalid character"]);
}

/// A spec that parses but that no runtime may run (a relative cwd): the
/// runtime's refusal must reach the user.
fn spec_the_runtime_refuses(rt: Runtime) {
    let cd = Containerd::start().expect("start containerd");
    let spec = cd.ctr().run(&["oci", "spec"]).expect("ctr oci spec");
    spec.assert_success();
    let mut v: serde_json::Value = serde_json::from_str(&spec.stdout).expect("default spec parses");
    v["root"]["path"] = cd.rootfs().display().to_string().into();
    v["process"]["args"] = serde_json::json!(["true"]);
    v["process"]["cwd"] = "relative/dir".into();
    v["linux"]["cgroupsPath"] = format!("/{}/badspec", cd.namespace()).into();
    let file = cd.dir().join("spec.json");
    std::fs::write(&file, v.to_string()).expect("write spec");
    let mut args = cd.container(rt, "badspec").rm().args().expect("args");
    let rootfs_at = args
        .iter()
        .position(|a| a == "--rootfs")
        .expect("--rootfs in args");
    args.truncate(rootfs_at);
    args.extend([
        "--config".into(),
        file.display().to_string(),
        "badspec".into(),
    ]);
    let out = cd.ctr().run(&args).expect("ctr run");
    assert_refused(&cd, &out, &["absolute path"]);
}

shadow_tests::runtime_arms!(
    missing_rootfs,
    missing_binary,
    unparsable_config,
    spec_the_runtime_refuses,
);

/// Only our shim knows `shadow.dev/*`: a value it does not know must be
/// refused at create, naming the key, before any process exists.
#[test]
fn shadow_refuses_unknown_gms_backend() {
    let cd = Containerd::start().expect("start containerd");
    let out = cd
        .container(Runtime::Shadow, "bogus")
        .rm()
        .annotation("shadow.dev/gms", "bogus")
        .cmd(&["true"])
        .run()
        .expect("ctr run");
    assert_refused(&cd, &out, &["shadow.dev/gms", "bogus"]);
}

/// The same annotation on the reference runtime is just metadata: proves
/// the refusal above comes from our shim, not from ctr or containerd.
#[test]
fn runc_v2_ignores_shadow_annotations() {
    let cd = Containerd::start().expect("start containerd");
    let out = cd
        .container(Runtime::RuncV2, "bogus")
        .rm()
        .annotation("shadow.dev/gms", "bogus")
        .cmd(&["true"])
        .run()
        .expect("ctr run");
    assert_eq!(out.code(), 0, "{out}");
    cd.assert_no_leftovers();
}

/// A shim config file that does not parse (named per container with
/// `ctr run --runtime-config-path`, as a CRI entry's `ConfigPath` names it)
/// is refused with an error naming the file, never silently ignored.
#[test]
fn shadow_refuses_unparsable_shim_config() {
    let cd = Containerd::start().expect("start containerd");
    let bad = cd.dir().join("shadow-bad.toml");
    std::fs::write(&bad, "log_level = \"info\"\n[runc\nbinary = ").expect("write config");
    let out = cd
        .container(Runtime::Shadow, "badconf")
        .rm()
        .flags(&["--runtime-config-path", &bad.display().to_string()])
        .cmd(&["true"])
        .run()
        .expect("ctr run");
    assert_refused(&cd, &out, &[&bad.display().to_string()]);
}
