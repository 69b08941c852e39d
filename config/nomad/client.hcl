# Nomad client (node) settings for the containerd task driver
# (github.com/Roblox/nomad-driver-containerd): the runtime is chosen per node,
# not per job. Every task this driver starts on the node then goes through
# containerd-shim-shadow-v1, which runs unpaired containers exactly as runc
# does. Merge into the client's config (e.g. /etc/nomad.d/client.hcl).
plugin "containerd-driver" {
  config {
    enabled            = true
    containerd_runtime = "io.containerd.shadow.v1"
    stats_interval     = "5s"
  }
}
