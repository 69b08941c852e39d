"""The torch engine as a pair through a private containerd on the GPU machine.

Imported by run.py (`make test-gpu`). Needs `runtime.tar.xz` from
`make gpu-bundle` in the bin dir: containerd, ctr, runc,
containerd-shim-runc-v2 and libseccomp from the build machine's Debian
packages, with the release shim, shadowctl and gmsd. Nothing is installed:
containerd runs from a temp dir with its own root, state and socket, and
is stopped (with everything it started) when the test ends.

The container's rootfs is a directory of bind mounts of this machine's
/usr, /etc, /opt and this repository (where python3, torch and the engine
are), run `--privileged --net-host` so it sees the GPU: the spec then
grants every host device, /dev/nvidia0 among them, and the shim finds the
pair's GPU there (never in the environment).
"""

import glob
import json
import os
import signal
import subprocess
import tarfile
import time

NS = "gpu"
SHIM_RUNTIME = "io.containerd.shadow.v1"
RUNC_RUNTIME = "io.containerd.runc.v2"
# Keep NVLink multicast off whatever the engine starts (the device docs).
NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1",
                "NVSHMEM_DISABLE_NVLS": "1"}


class Runtime:
    """A private containerd with the bundle's binaries first on its PATH."""

    def __init__(self, base, bin_dir, root):
        self.base = base
        self.root = root
        self.bin_dir = os.path.abspath(bin_dir)
        tar = os.path.join(bin_dir, "runtime.tar.xz")
        if not os.path.exists(tar):
            raise AssertionError(f"missing {tar}: run `make gpu-bundle` on a build machine")
        with tarfile.open(tar) as t:
            t.extractall(base, filter="tar")
        self.bin = os.path.join(base, "runtime", "bin")
        self.lib = os.path.join(base, "runtime", "lib")
        self.cd = os.path.join(base, "cd")
        os.makedirs(os.path.join(self.cd, "fifo"), exist_ok=True)
        self.address = os.path.join(self.cd, "containerd.sock")
        self.state_dir = os.path.join(base, "p")
        self.metrics_dir = os.path.join(base, "m")
        self.env = dict(os.environ, PATH=f"{self.bin}:{os.environ.get('PATH', '/usr/bin:/bin')}",
                        LD_LIBRARY_PATH=":".join(x for x in (self.lib, os.environ.get("LD_LIBRARY_PATH")) if x))
        config = os.path.join(self.cd, "config.toml")
        with open(config, "w") as f:
            f.write(f"""version = 2
root = "{self.cd}/root"
state = "{self.cd}/state"
disabled_plugins = ["io.containerd.grpc.v1.cri"]
[grpc]
  address = "{self.address}"
[ttrpc]
  address = "{self.address}.ttrpc"
[debug]
  address = "{self.cd}/debug.sock"
  level = "info"
[metrics]
  address = ""
[plugins."io.containerd.internal.v1.opt"]
  path = "{self.cd}/opt"
""")
        self.shim_config = os.path.join(base, "shadow.toml")
        with open(self.shim_config, "w") as f:
            # GPU_SHIM_LOG_LEVEL=debug: every notify datagram in containerd.log.
            f.write(f"""log_level = "{os.environ.get('GPU_SHIM_LOG_LEVEL', 'info')}"
[pair]
state_dir = "{self.state_dir}"
metrics_dir = "{self.metrics_dir}"
gmsd = "{self.bin}/gmsd"
""")
            # gmsd may hold the whole GPU: a KV pool sized to fill it is
            # what the KV-fills-the-GPU test deploys (gmsd's default is 64G).
            total = _gpu_total_bytes()
            if total:
                f.write(f"gms_max_bytes = {total}\n")
        self.log_path = os.path.join(base, "containerd.log")
        with open(self.log_path, "w") as log:
            self.p = subprocess.Popen([os.path.join(self.bin, "containerd"), "--config", config],
                                      stdout=log, stderr=subprocess.STDOUT, env=self.env,
                                      start_new_session=True)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.p.poll() is not None:
                raise AssertionError(f"containerd ended at its start (rc {self.p.poll()}): {self.log_tail()}")
            if self.ctr("version", check=False, timeout=10).returncode == 0:
                break
            time.sleep(0.1)
        else:
            why = self.ctr("version", check=False, timeout=10).stderr.strip()
            self.stop()
            raise AssertionError(f"containerd did not answer within 30 s ({why}): {self.log_tail()}")
        self.rootfs = self._rootfs()

    def alive(self):
        return self.p.poll() is None

    def log_tail(self, n=3000):
        """The end of containerd's log (the shim's lines are in it), also
        once containerd has ended."""
        try:
            with open(self.log_path, errors="replace") as f:
                return f.read()[-n:]
        except OSError as e:
            return f"(no log at {self.log_path}: {e})"

    def ctr(self, *args, check=True, timeout=60):
        out = subprocess.run([os.path.join(self.bin, "ctr"), "--address", self.address, "--namespace", NS,
                              *args], capture_output=True, text=True, env=self.env, timeout=timeout)
        if check and out.returncode != 0:
            raise AssertionError(f"ctr {' '.join(args)}: {out.stderr.strip()}")
        return out

    def _rootfs(self):
        r = os.path.join(self.base, "rootfs")
        for d in ("usr", "etc", "opt", "proc", "dev", "sys", "tmp", "run", "root", self.root.lstrip("/"),
                  self.bin_dir.lstrip("/")):
            os.makedirs(os.path.join(r, d), exist_ok=True)
        for link in ("bin", "sbin", "lib", "lib64", "lib32"):
            host = os.path.join("/", link)
            if os.path.islink(host):
                os.symlink(os.readlink(host), os.path.join(r, link))
            elif os.path.isdir(host):
                os.makedirs(os.path.join(r, link), exist_ok=True)
        self.tmp = os.path.join(self.base, "ctmp")
        os.makedirs(self.tmp, exist_ok=True)
        return r

    def run_args(self, runtime, cid, env, cmd, extra=()):
        mounts = []
        for src, dst, mode in (("/usr", "/usr", "ro"), ("/etc", "/etc", "ro"), ("/opt", "/opt", "ro"),
                               (self.root, self.root, "ro"), (self.tmp, "/tmp", "rw")):
            mounts += ["--mount", f"type=bind,src={src},dst={dst},options=rbind:{mode}"]
        # libgms.so and the binaries, when the bin dir is not in the repository.
        if not (self.bin_dir + "/").startswith(self.root.rstrip("/") + "/"):
            src = dst = self.bin_dir
            mode = "ro"
            mounts += ["--mount", f"type=bind,src={src},dst={dst},options=rbind:{mode}"]
        for host in ("/lib", "/lib64", "/bin", "/sbin"):
            if os.path.isdir(host) and not os.path.islink(host):
                mounts += ["--mount", f"type=bind,src={host},dst={host},options=rbind:ro"]
        envs = []
        for k, v in env.items():
            envs += ["--env", f"{k}={v}"]
        return [os.path.join(self.bin, "ctr"), "--address", self.address, "--namespace", NS, "run",
                "--runtime", runtime, "--fifo-dir", os.path.join(self.cd, "fifo"), "--rm",
                "--privileged", "--net-host", *extra, *envs, *mounts, "--rootfs", self.rootfs, cid, *cmd]

    def state(self, cid):
        # The shim keeps each containerd's pairs under a key of its own
        # (state_dir/<key>/<namespace>/<id>); this test runs one containerd.
        found = glob.glob(os.path.join(glob.escape(self.state_dir), "*", NS, cid, "state.json"))
        if len(found) != 1:
            return None
        try:
            with open(found[0]) as f:
                return json.load(f)
        except (OSError, ValueError):
            return None

    def task(self, cid):
        """(pid, status) of the task as `ctr task ls` shows it, or None."""
        for line in self.ctr("task", "ls", check=False).stdout.splitlines()[1:]:
            parts = line.split()
            if len(parts) >= 3 and parts[0] == cid:
                return int(parts[1]), parts[2]
        return None

    def stop(self):
        """Ends containerd (its process group); again is a no-op."""
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGTERM)
            try:
                self.p.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait(10)


def _gpu_total_bytes():
    """GPU 0's memory in bytes (nvidia-smi), or None."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.total", "--format=csv,noheader,nounits", "-i", "0"],
                             capture_output=True, text=True, timeout=30).stdout
        return int(out.split()[0]) << 20
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def engine_env(port, layers, kv_gib, bin_dir):
    env = {k: v for k, v in os.environ.items()
           if k in ("PATH", "LD_LIBRARY_PATH", "CUDA_HOME", "PYTHONPATH") or k.startswith(("CUDA_", "CUBLAS_"))}
    env.update(NO_MULTICAST, HOME="/tmp", PYTHONUNBUFFERED="1", ENGINE_PORT=str(port),
               ENGINE_LAYERS=str(layers), ENGINE_KV_GIB=str(kv_gib),
               GMS_LIB=os.path.join(bin_dir, "libgms.so"))
    return env


def _ancestors():
    """This process and those above it (make, a shell): never ours to end,
    whatever their command lines name."""
    out, pid = set(), os.getpid()
    while pid > 1 and pid not in out:
        out.add(pid)
        try:
            with open(f"/proc/{pid}/stat") as f:
                pid = int(f.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            break
    return out


def our_processes(markers):
    """pid -> cmdline of processes whose command line names any marker
    (this process and its ancestors aside)."""
    out = {}
    mine = _ancestors()
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) in mine:
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if any(m in cmd for m in markers):
            out[int(pid)] = cmd
    return out


def mounts_under(path):
    with open("/proc/self/mountinfo") as f:
        return [line.split()[4] for line in f if line.split()[4].startswith(path)]
