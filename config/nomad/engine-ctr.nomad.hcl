# A paired engine under Nomad today: raw_exec runs a small sh supervisor
# (the template below) that starts the pair detached with `ctr run`, then
# follows it with `ctr task attach`: the engines' output reaches Nomad's
# log, Nomad's stop signal reaches the task, and the task's exit status is
# the Nomad task's. It is detached on purpose: since containerd 2.0 a
# foreground `ctr run` kills its task when containerd comes back after a
# restart, while a detached pair outlives any number of restarts (the
# supervisor attaches again). It also adopts a pair it finds still running
# under its id (the task restarted after the supervisor was killed).
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
        command = "/bin/sh"
        args    = ["local/ctr-pair.sh"]
      }

      # The script is POSIX sh; it writes no `${`, which HCL would expand.
      # CONTAINERD_ADDRESS and CONTAINERD_NAMESPACE (ctr's own variables)
      # and CTR_RUN_FLAGS (more `ctr run` flags, e.g. --log-uri) may come
      # from an env block.
      template {
        destination = "local/ctr-pair.sh"
        perms       = "0755"
        data        = <<EOF
#!/bin/sh
id="llm-engine-$NOMAD_ALLOC_ID"
[ -n "$CONTAINERD_NAMESPACE" ] || CONTAINERD_NAMESPACE=nomad
export CONTAINERD_NAMESPACE

# The task's status, waiting while containerd does not answer (a restart).
status() {
  until out=$(ctr task ls 2>/dev/null); do sleep 1; done
  printf '%s\n' "$out" | awk -v id="$id" '$1 == id { print $3 }'
}

case "$(status)" in
  RUNNING|PAUSED|PAUSING|CREATED) echo "adopting running pair $id" >&2 ;;
  *)
    ctr container delete "$id" >/dev/null 2>&1
    # shellcheck disable=SC2086 # CTR_RUN_FLAGS is a list of flags
    ctr run --detach --net-host $CTR_RUN_FLAGS \
      --runtime io.containerd.shadow.v1 --annotation shadow.dev/pair=true \
      --env PORT=8000 registry.example.com/llm/engine:1.0 "$id" \
      /engine --port 8000 || [ -n "$(status)" ] || exit 1
    ;;
esac

# Nomad's stop signal goes to the task; the shim signals both engines.
trap 'ctr task kill --signal SIGTERM "$id"' TERM
trap 'ctr task kill --signal SIGINT "$id"' INT

# containerd makes its socket anew at each start: another inode or mtime is a restart.
sock=$CONTAINERD_ADDRESS
[ -n "$sock" ] || sock=/run/containerd/containerd.sock

code=0
stopped=
while :; do
  # attach streams the task's output and ends with its exit status (and
  # deletes the stopped task). After a containerd restart ctr 1.6's attach
  # can hang on its own IO: a watcher ends it (SIGKILL: attach would
  # forward any other signal to the task) once the socket is a new one.
  boot=$(stat -c "%i %y" "$sock" 2>/dev/null)
  ctr task attach "$id" &
  attach=$!
  (
    while kill -0 "$attach" 2>/dev/null; do
      sleep 1
      if [ "$(stat -c "%i %y" "$sock" 2>/dev/null)" != "$boot" ]; then
        kill -KILL "$attach" 2>/dev/null
        break
      fi
    done
  ) &
  watcher=$!
  # A trapped signal ends `wait` early; the attach goes on.
  while :; do
    wait "$attach"
    code=$?
    kill -0 "$attach" 2>/dev/null || break
  done
  kill "$watcher" 2>/dev/null
  case "$(status)" in
    "") break ;;
    # Ended while containerd was away: one more attach reads its status.
    STOPPED)
      if [ -n "$stopped" ]; then ctr task delete "$id" >/dev/null 2>&1; break; fi
      stopped=1 ;;
    *) sleep 1 ;;
  esac
done
ctr container delete "$id" >/dev/null 2>&1
exit "$code"
EOF
      }

      kill_signal  = "SIGTERM"
      kill_timeout = "30s"
    }
  }
}
