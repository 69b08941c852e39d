# A paired engine under Nomad today: raw_exec runs `ctr run` in the
# foreground; ctr asks containerd for the shadow runtime and the pairing
# annotation, and forwards Nomad's stop signal to the task.
#   nomad job run config/nomad/engine-ctr.nomad.hcl
# Needs raw_exec enabled on the client (plugin "raw_exec" { config { enabled = true } }),
# the image pulled once (`ctr -n nomad images pull registry.example.com/llm/engine:1.0`),
# and containerd-shim-shadow-v1 on containerd's PATH. See docs/nomad.md.
job "llm-engine-pair" {
  datacenters = ["dc1"]
  type        = "service"

  group "engine" {
    count = 1

    task "engine" {
      driver = "raw_exec"

      config {
        command = "/usr/bin/ctr"
        args = [
          "--namespace", "nomad",
          "run", "--rm", "--net-host",
          "--runtime", "io.containerd.shadow.v1",
          "--annotation", "shadow.dev/pair=true",
          "--env", "PORT=8000",
          "registry.example.com/llm/engine:1.0",
          "llm-engine-${NOMAD_ALLOC_ID}",
          "/engine", "--port", "8000",
        ]
      }

      # ctr forwards SIGTERM to the task; the shim signals both engines.
      kill_signal  = "SIGTERM"
      kill_timeout = "30s"
    }
  }
}
