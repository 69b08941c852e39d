//! The GPUs of a pair: those the spec's device list grants, never those its
//! environment names.
//!
//! `NVIDIA_VISIBLE_DEVICES` is a variable of the pod's own: any pod can set
//! it to another tenant's GPU. What the container can open is what
//! `linux.devices` grants (the NVIDIA device plugin, CDI or the NVIDIA
//! runtime put the `/dev/nvidiaN` nodes there, and runc allows exactly those
//! in the device cgroup). So a pair's GPUs are the character devices of the
//! NVIDIA major in that list, each mapped by its minor number to the GPU's
//! UUID and PCI bus through the driver's
//! `/proc/driver/nvidia/gpus/<bus>/information` (`Device Minor:`,
//! `GPU UUID:`). No NVML and no CUDA context are needed.

use std::path::Path;

use serde_json::Value;

/// The character-device major of the NVIDIA driver's `/dev/nvidiaN` nodes.
pub const NVIDIA_MAJOR: i64 = 195;
/// Minors above this are the driver's own control nodes (`nvidia-modeset`
/// 254, `nvidiactl` 255), not GPUs.
const LAST_GPU_MINOR: i64 = 253;

/// One GPU of the pair.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Gpu {
    /// The minor of its `/dev/nvidiaN` node.
    pub minor: u32,
    /// `GPU-<uuid>`, as `nvidia-smi -L` prints it: names its gmsd socket.
    pub uuid: String,
    /// PCI bus id, lower case without the function (`0000:3b:00`): XIDs
    /// in the kernel log name it.
    pub bus: String,
}

/// The minors of the NVIDIA GPU nodes the spec's `linux.devices` grants, in
/// the spec's order, each once.
pub fn granted_minors(spec: &Value) -> Vec<u32> {
    let mut out = Vec::new();
    for d in spec
        .pointer("/linux/devices")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let char_device = d.get("type").and_then(Value::as_str) == Some("c");
        let major = d.get("major").and_then(Value::as_i64);
        let minor = d.get("minor").and_then(Value::as_i64);
        if let (true, Some(NVIDIA_MAJOR), Some(m)) = (char_device, major, minor) {
            if (0..=LAST_GPU_MINOR).contains(&m) && !out.contains(&(m as u32)) {
                out.push(m as u32);
            }
        }
    }
    out
}

/// The GPUs of `minors`, from the driver's per-GPU directory (normally
/// `/proc/driver/nvidia/gpus`). A minor the driver does not know is an
/// error: the spec grants a device this host cannot name.
pub fn resolve(gpus_dir: &Path, minors: &[u32]) -> Result<Vec<Gpu>, String> {
    if minors.is_empty() {
        return Ok(Vec::new());
    }
    let dir = std::fs::read_dir(gpus_dir).map_err(|e| {
        format!(
            "reading {} (is the NVIDIA driver loaded?): {e}",
            gpus_dir.display()
        )
    })?;
    let mut known = Vec::new();
    for entry in dir.flatten() {
        let bus = entry.file_name().to_string_lossy().into_owned();
        let info = std::fs::read_to_string(entry.path().join("information")).unwrap_or_default();
        let field = |key: &str| {
            info.lines()
                .find_map(|l| l.strip_prefix(key))
                .map(|v| v.trim().to_string())
        };
        let (Some(uuid), Some(minor)) = (
            field("GPU UUID:").filter(|u| valid_uuid(u)),
            field("Device Minor:").and_then(|m| m.parse::<u32>().ok()),
        ) else {
            continue;
        };
        let bus = super::xid::normalise_bus(&bus);
        known.push(Gpu { minor, uuid, bus });
    }
    minors
        .iter()
        .map(|m| {
            known.iter().find(|g| g.minor == *m).cloned().ok_or_else(|| {
                format!(
                    "the spec grants /dev/nvidia{m} (minor {m}) but no GPU with that minor is in {}",
                    gpus_dir.display()
                )
            })
        })
        .collect()
}

/// `GPU-` and hex digits and dashes, of a UUID's length at most: it names a
/// socket file.
fn valid_uuid(u: &str) -> bool {
    u.len() <= "GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx".len()
        && u.strip_prefix("GPU-").is_some_and(|rest| {
            !rest.is_empty() && rest.chars().all(|c| c.is_ascii_hexdigit() || c == '-')
        })
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn gpu_dir(d: &Path, bus: &str, minor: u32, uuid: &str) {
        let p = d.join(bus);
        std::fs::create_dir_all(&p).unwrap();
        std::fs::write(
            p.join("information"),
            format!("Model: \t\t NVIDIA H200\nGPU UUID: \t {uuid}\nDevice Minor: \t {minor}\n"),
        )
        .unwrap();
    }

    fn device(major: i64, minor: i64) -> Value {
        json!({"path": format!("/dev/nvidia{minor}"), "type": "c", "major": major, "minor": minor})
    }

    #[test]
    fn only_gpu_nodes_of_the_nvidia_major_count_and_never_the_environment() {
        let spec = json!({
            "process": {"env": ["NVIDIA_VISIBLE_DEVICES=0,1,2"]},
            "linux": {"devices": [
                device(195, 255),               // nvidiactl
                device(195, 254),               // nvidia-modeset
                device(1, 3),                   // /dev/null's major
                device(195, 2),
                {"path": "/dev/nvidia1", "type": "b", "major": 195, "minor": 1},
                device(195, 2),
            ]},
        });
        assert_eq!(granted_minors(&spec), [2]);
        let none = json!({"process": {"env": ["NVIDIA_VISIBLE_DEVICES=all"]}});
        assert!(granted_minors(&none).is_empty());
    }

    #[test]
    fn minors_resolve_to_uuids_and_buses() {
        let d = tempfile::tempdir().unwrap();
        let a = "GPU-aaaaaaaa-bbbb-cccc-dddd-eeeeeeeeeeee";
        let b = "GPU-11111111-2222-3333-4444-555555555555";
        gpu_dir(d.path(), "0000:3B:00.0", 0, a);
        gpu_dir(d.path(), "0000:c1:00.0", 1, b);
        let gpus = resolve(d.path(), &[1, 0]).unwrap();
        assert_eq!(
            gpus,
            [
                Gpu {
                    minor: 1,
                    uuid: b.into(),
                    bus: "0000:c1:00".into()
                },
                Gpu {
                    minor: 0,
                    uuid: a.into(),
                    bus: "0000:3b:00".into()
                }
            ]
        );
        let e = resolve(d.path(), &[7]).unwrap_err();
        assert!(e.contains("/dev/nvidia7"), "{e}");
        assert!(resolve(&d.path().join("absent"), &[0])
            .unwrap_err()
            .contains("driver"));
        assert!(resolve(&d.path().join("absent"), &[]).unwrap().is_empty());
    }

    #[test]
    fn a_uuid_that_is_not_one_is_not_used() {
        let d = tempfile::tempdir().unwrap();
        gpu_dir(d.path(), "0000:3b:00.0", 0, "GPU-../../etc");
        assert!(resolve(d.path(), &[0]).is_err());
    }
}
