# An engine job for the containerd task driver, on nodes configured with
# config/nomad/client.hcl (containerd_runtime = "io.containerd.shadow.v1").
#   nomad job run config/nomad/engine.nomad.hcl
#
# Known gap: this driver has no option to set OCI annotations, so it cannot
# ask for pairing (shadow.dev/pair); the task runs through the shadow shim
# as a plain container. engine-ctr.nomad.hcl pairs today through raw_exec
# and ctr. See docs/nomad.md.
job "llm-engine" {
  datacenters = ["dc1"]
  type        = "service"

  group "engine" {
    count = 1

    task "engine" {
      driver = "containerd-driver"

      config {
        image        = "registry.example.com/llm/engine:1.0"
        args         = ["--port", "8000"]
        host_network = true
      }

      env {
        PORT = "8000"
      }

      resources {
        cpu    = 2000
        memory = 4096
      }
    }
  }
}
