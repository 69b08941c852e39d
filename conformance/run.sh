#!/usr/bin/env bash
# make conformance: containerd's own integration/client suite (the bar
# containerd/rust-extensions holds its shim to, with TEST_RUNTIME) against
# io.containerd.runc.v2, io.containerd.shadow.v1, and shadow.v1 with every
# container a pair (`[pair] pair_by_default = true`), side by side, offline.
#
#   1. Debian packages: Go 1.19 and containerd 1.6.20's Go source (GOPATH mode).
#   2. The suite's test files from Debian's source package of containerd,
#      fetched with a private apt configuration into $OUT (never committed).
#   3. Build: the suite (`go test -c`), conformance/registry, the shim and gmsd.
#   4. conformance-registry: an HTTPS proxy on 127.0.0.1 with a private CA
#      that serves the suite's test images, made from busybox-static.
#   5. Every top-level test in its own process against its own containerd
#      (root, state, socket, TMPDIR in a temp dir), -no-criu, one at a time,
#      TIMEOUT seconds each; then everything it left is killed and removed.
#   6. The table: $OUT/results.md and $OUT/results.json.
#
# Environment: CONFORMANCE_OUT (default target/conformance), CONFORMANCE_RUNS
# (default "runc.v2 shadow.v1 shadow.v1+pairs"), CONFORMANCE_TESTS (a regex of
# test names, default all), CONFORMANCE_TIMEOUT (seconds a test, default 180),
# CONFORMANCE_PROFILE (the shim's cargo profile, default debug),
# CONFORMANCE_KEEP=1 (replace only the results of the tests run this time).
#
# Nothing here may run `sleep 1`: two tests look for that command in the
# host's `ps ax`.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
OUT=${CONFORMANCE_OUT:-$ROOT/target/conformance}
RUNS=${CONFORMANCE_RUNS:-"runc.v2 shadow.v1 shadow.v1+pairs"}
TESTS=${CONFORMANCE_TESTS:-.}
TIMEOUT=${CONFORMANCE_TIMEOUT:-180}
PROFILE=${CONFORMANCE_PROFILE:-debug}
# 1: keep the results of the tests not run this time (rerun a few tests).
KEEP=${CONFORMANCE_KEEP:-0}
# Below this much free space on /tmp the run stops (KiB).
MIN_FREE_KIB=$((1024 * 1024))
# The suite's namespaces ("testing", and "testing-<test>" in a few tests):
# the runc state and cgroups that cleanup looks at.
SUITE_NS=testing

log() { printf 'conformance: %s\n' "$*" >&2; }

if [ "$(id -u)" != 0 ]; then
    log "needs root (containerd, runc, mounts)"
    exit 1
fi
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)

# --- 1. packages -----------------------------------------------------------
DEBS=(golang-go golang-github-containerd-containerd-dev golang-github-gotestyourself-gotest.tools-dev
      containerd runc busybox-static ca-certificates)
missing=()
for p in "${DEBS[@]}"; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ "${#missing[@]}" -gt 0 ]; then
    log "installing ${missing[*]}"
    apt-get update
    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends "${missing[@]}"
fi
REAL_CONTAINERD=$(command -v containerd)

# --- 2. the suite's sources, from Debian's source package --------------------
# A private apt configuration: one deb-src line, its own lists and cache, so
# the host's sources.list is left as it is.
APT="$OUT/apt"
SRC="$OUT/src"
if ! compgen -G "$SRC/containerd_*.orig.tar.xz" >/dev/null; then
    mkdir -p "$APT/lists/partial" "$APT/cache/archives/partial" "$SRC"
    echo "deb-src [signed-by=/usr/share/keyrings/debian-archive-keyring.gpg] http://deb.debian.org/debian bookworm main" \
        >"$APT/sources.list"
    apt_opts=(-o "Dir::Etc::SourceList=$APT/sources.list" -o Dir::Etc::SourceParts=/dev/null
              -o "Dir::State::Lists=$APT/lists" -o "Dir::Cache=$APT/cache")
    log "fetching Debian's containerd source package"
    apt-get "${apt_opts[@]}" update
    (cd "$SRC" && apt-get "${apt_opts[@]}" source --download-only containerd)
fi
orig=$(compgen -G "$SRC/containerd_*.orig.tar.xz" | head -n1)

# A private GOPATH: the suite as a package of its own, Debian's Go packages after it.
GOPATH_DIR="$OUT/gopath"
PKG="$GOPATH_DIR/src/shadowconformance/client"
rm -rf "$PKG"
mkdir -p "$PKG" "$GOPATH_DIR/src/gotest.tools"
tar -xJf "$orig" -C "$PKG" --strip-components=3 --wildcards '*/integration/client/*_test.go'
# Debian ships gotest.tools v3 at its v1 import path; the suite imports /v3.
ln -sfn /usr/share/gocode/src/gotest.tools "$GOPATH_DIR/src/gotest.tools/v3"
# The one change to the suite: waitForStart retries (conformance/suite/).
sed -i 's/^func (d \*daemon) waitForStart(/func (d *daemon) waitForStartOnce(/' "$PKG/daemon_test.go"
grep -q 'waitForStartOnce(' "$PKG/daemon_test.go" || { log "daemon_test.go: waitForStart not found"; exit 1; }
cp "$ROOT/conformance/suite/zz_wait_retry_test.go" "$PKG/"

# --- 3. build ----------------------------------------------------------------
BIN="$OUT/bin"
mkdir -p "$BIN"
log "building the suite and conformance-registry (Go $(go env GOVERSION))"
(cd "$PKG" && GO111MODULE=off GOPATH="$GOPATH_DIR:/usr/share/gocode" GOFLAGS='' \
    nice go test -c -o "$BIN/client.test" .)
(cd "$ROOT/conformance/registry" && GO111MODULE=off GOFLAGS='' nice go build -o "$BIN/conformance-registry" .)
if [ "$PROFILE" = release ]; then cargo_profile=(--release); else cargo_profile=(); fi
log "building the shim and gmsd ($PROFILE)"
(cd "$ROOT" && nice cargo build -q "${cargo_profile[@]}" --bin containerd-shim-shadow-v1 --bin gmsd)

# containerd's PATH for the tests: our shim and gmsd, and a `containerd` that
# moves the suite daemon's fixed root and state into the test's own dir.
PATHDIR="$OUT/path"
mkdir -p "$PATHDIR"
ln -sfn "$ROOT/target/$PROFILE/containerd-shim-shadow-v1" "$PATHDIR/containerd-shim-shadow-v1"
ln -sfn "$ROOT/target/$PROFILE/gmsd" "$PATHDIR/gmsd"
cat >"$PATHDIR/containerd" <<EOF
#!/usr/bin/env bash
# Written by conformance/run.sh. The suite starts its daemon with the fixed
# --root /var/lib/containerd-test; each test gets its own under
# \$CONFORMANCE_DIR instead. The state stays /run/containerd-test: a test
# reads a shim's log there by that path (the harness empties it after each
# test). Other daemons (tests that bring their own config) pass unchanged.
set -euo pipefail
args=()
for a in "\$@"; do
    case "\$a" in
        /var/lib/containerd-test) args+=("\$CONFORMANCE_DIR/root") ;;
        *) args+=("\$a") ;;
    esac
done
# exec: the suite signals and waits for this very pid.
exec "$REAL_CONTAINERD" "\${args[@]}"
EOF
chmod 0755 "$PATHDIR/containerd"

# --- 4. the registry ---------------------------------------------------------
REG="$OUT/registry"
rm -rf "$REG"
mkdir -p "$REG"
"$BIN/conformance-registry" serve --dir "$REG" >"$REG/registry.log" 2>&1 &
REG_PID=$!
cleanup_registry() { kill "$REG_PID" 2>/dev/null || true; }
trap cleanup_registry EXIT
for _ in $(seq 100); do
    [ -s "$REG/proxy.url" ] && break
    kill -0 "$REG_PID" 2>/dev/null || { log "registry died: $(cat "$REG/registry.log")"; exit 1; }
    sleep 0.2
done
[ -s "$REG/proxy.url" ] || { log "registry did not start"; exit 1; }
PROXY=$(cat "$REG/proxy.url")
log "registry at $PROXY"

# --- 5. the tests ------------------------------------------------------------
mapfile -t ALL_TESTS < <("$BIN/client.test" -test.short -test.list '.*' | grep '^Test' | grep -E -- "$TESTS" || true)
log "${#ALL_TESTS[@]} tests × runs: $RUNS"

# Processes whose command line names $1 (containerd, shims, gmsd, ctr).
pids_naming() {
    local dir=$1 p
    for p in /proc/[0-9]*; do
        [ "${p#/proc/}" = "$$" ] && continue
        if { tr '\0' ' ' <"$p/cmdline"; } 2>/dev/null | grep -qF -- "$dir"; then
            echo "${p#/proc/}"
        fi
    done
}

# Take down everything one test left: its daemon(s) and shims, the suite
# namespace's runc containers, mounts under its dirs, cgroups, stale shim sockets.
SUITE_STATE=/run/containerd-test
cleanup_test() {
    local dir=$1 sockets_before=$2 pid root id mnt d
    for pid in $(pids_naming "$dir"); do kill -KILL "$pid" 2>/dev/null || true; done
    # The shims' runc root for the suite's namespace, and any runc root a
    # test made in its temp dir (<root>/<namespace>/<id>/state.json).
    # TestKillContainerDeletedByRunc names /tmp/runc-test as its runc root.
    for root in /run/containerd/runc/"$SUITE_NS" /run/containerd/runc/"$SUITE_NS"-* /tmp/runc-test/"$SUITE_NS" $(find "$dir" -maxdepth 8 -name state.json -printf '%h\n' 2>/dev/null | xargs -r -n1 dirname | sort -u); do
        [ -d "$root" ] || continue
        for id in $(runc --root "$root" list -q 2>/dev/null); do
            runc --root "$root" kill --all "$id" KILL >/dev/null 2>&1 || true
            runc --root "$root" delete --force "$id" >/dev/null 2>&1 || true
        done
    done
    rm -rf /run/containerd/runc/"$SUITE_NS" /run/containerd/runc/"$SUITE_NS"-* /tmp/runc-test
    # Mounts under the test's dirs, deepest first.
    for d in "$dir" "$SUITE_STATE"; do
        while read -r mnt; do
            umount -l "$mnt" 2>/dev/null || true
        done < <(awk -v d="$d/" 'index($5, d) == 1 { print $5 }' /proc/self/mountinfo | sort -r)
    done
    # cgroup v1 hierarchies and the v2 one: <controller>/<namespace>/<id>.
    find /sys/fs/cgroup -mindepth 1 -maxdepth 3 -type d \( -name "$SUITE_NS" -o -name "$SUITE_NS-*" \) 2>/dev/null | while read -r cg; do
        find "$cg" -depth -type d -exec rmdir {} \; 2>/dev/null || true
    done
    # Shim sockets created during the test that nothing listens on any more.
    for s in /run/containerd/s/*; do
        [ -S "$s" ] || continue
        grep -qxF -- "$(basename "$s")" <<<"$sockets_before" && continue
        grep -qF -- "$s" /proc/net/unix || rm -f -- "$s"
    done
    rm -rf -- "$dir" "$SUITE_STATE"
}

# A run that was interrupted left its test's dir behind: clean that first.
for stale in /tmp/shadow-conf.*; do
    [ -d "$stale" ] && cleanup_test "$stale" ""
done
dir=""
sockets_before=""
on_exit() {
    cleanup_registry
    if [ -n "$dir" ] && [ -d "$dir" ]; then cleanup_test "$dir" "$sockets_before"; fi
}
trap on_exit EXIT

# Two tests (initContainerAndCheckChildrenDieOnKill) look for "sleep 1" in
# the host's `ps ax`, and so fail whenever anyone on the machine runs, say,
# `sleep 100`: they get a PID namespace (and /proc) of their own, in which
# their containerd, shims and containers run as usual.
PRIVATE_PID_TESTS=" TestContainerKillInitPidHost TestContainerKillInitKillsChildWhenNotHostPid "

# run_test RUN RUNTIME PAIRS TEST LOG: one test in its own process against
# its own containerd, then cleanup; sets rc and secs.
run_test() {
    local run=$1 runtime=$2 pairs=$3 t=$4 logfile=$5 t0
    local -a env_extra=() wrap=()
    dir=$(mktemp -d /tmp/shadow-conf.XXXXXX)
    # Searchable by others: a user-namespaced container's root (uid 1000
    # on the host) must reach its rootfs below.
    chmod 0711 "$dir"
    mkdir -p "$dir/tmp"
    if [ "$pairs" = true ]; then
        # containerd passes its environment to the shims it starts.
        printf '[pair]\npair_by_default = true\nstate_dir = "%s/shadow"\nmetrics_dir = "%s/shadow/metrics"\n' \
            "$dir" "$dir" >"$dir/shadow.toml"
        env_extra+=("SHADOW_CONFIG=$dir/shadow.toml")
    fi
    case "$PRIVATE_PID_TESTS" in
        *" $t "*) wrap=(unshare --pid --fork --mount-proc) ;;
    esac
    sockets_before=$(ls /run/containerd/s 2>/dev/null || true)
    t0=$(date +%s.%N)
    rc=0
    (cd "$dir" && env "${env_extra[@]}" \
        PATH="$PATHDIR:$PATH" TMPDIR="$dir/tmp" CONFORMANCE_DIR="$dir" \
        TEST_RUNTIME="$runtime" HTTPS_PROXY="$PROXY" https_proxy="$PROXY" NO_PROXY='' no_proxy='' \
        SSL_CERT_FILE="$REG/ca.pem" \
        timeout -k 10 "$TIMEOUT" "${wrap[@]}" "$BIN/client.test" -test.root -test.v -test.parallel 1 \
            -test.run "^${t}\$" -no-criu -address "$dir/containerd.sock") \
        >"$logfile" 2>&1 || rc=$?
    secs=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
    cleanup_test "$dir" "$sockets_before"
}

# PASS, FAIL, SKIP or TIMEOUT of one attempt, for the progress lines.
status_of() {
    local t=$1 logfile=$2 rc=$3 s
    if [ "$rc" = 124 ] || [ "$rc" = 137 ]; then echo TIMEOUT; return; fi
    s=$(grep -oE "^--- (PASS|FAIL|SKIP): $t " "$logfile" | head -n1 | cut -d' ' -f2 | tr -d :) || true
    echo "${s:-FAIL}"
}

RESULTS="$OUT/results.tsv"
LOGS="$OUT/logs"
if [ "$KEEP" = 1 ] && [ -f "$RESULTS" ]; then
    log "keeping the results of other tests in $RESULTS"
else
    : >"$RESULTS"
    rm -rf "$LOGS"
fi
started=$(date +%s)
for run in $RUNS; do
    case "$run" in
        runc.v2) runtime=io.containerd.runc.v2; pairs=false ;;
        shadow.v1) runtime=io.containerd.shadow.v1; pairs=false ;;
        shadow.v1+pairs) runtime=io.containerd.shadow.v1; pairs=true ;;
        *) log "unknown run $run (runc.v2, shadow.v1, shadow.v1+pairs)"; exit 1 ;;
    esac
    mkdir -p "$LOGS/$run"
    for t in "${ALL_TESTS[@]}"; do
        # A full disk fails every test after it for a reason of its own
        # (containerd cannot unpack the image): stop instead.
        free_kib=$(df -Pk /tmp | awk 'NR == 2 { print $4 }')
        if [ "$free_kib" -lt "$MIN_FREE_KIB" ]; then
            log "only $((free_kib / 1024)) MiB free on /tmp: stopping before $run $t (rerun with CONFORMANCE_KEEP=1)"
            exit 1
        fi
        rm -f "$LOGS/$run/$t.log" "$LOGS/$run/$t.retry.log"
        run_test "$run" "$runtime" "$pairs" "$t" "$LOGS/$run/$t.log"
        status=$(status_of "$t" "$LOGS/$run/$t.log" "$rc")
        first_rc=$rc first_secs=$secs retry_rc=""
        # A failure (not a timeout) gets one more try: a pass then marks the
        # test flaky rather than failed, so that a timing race on this shared
        # machine is not reported as a difference between runtimes.
        if [ "$status" = FAIL ]; then
            run_test "$run" "$runtime" "$pairs" "$t" "$LOGS/$run/$t.retry.log"
            retry_rc=$rc
            status="$status, retry $(status_of "$t" "$LOGS/$run/$t.retry.log" "$rc")"
        fi
        # One line per run and test: a rerun replaces the earlier one.
        awk -F '\t' -v r="$run" -v t="$t" '!($1 == r && $2 == t)' "$RESULTS" >"$RESULTS.tmp"
        printf '%s\t%s\t%s\t%s\t%s\n' "$run" "$t" "$first_rc" "$first_secs" "$retry_rc" >>"$RESULTS.tmp"
        mv "$RESULTS.tmp" "$RESULTS"
        printf 'conformance: %-16s %-48s %-18s %5ss\n' "$run" "$t" "$status" "$first_secs" >&2
    done
done
log "all runs took $(( $(date +%s) - started )) s"

# --- 6. the table --------------------------------------------------------------
"$BIN/conformance-registry" table --results "$RESULTS" --logs "$LOGS" \
    --md "$OUT/results.md" --json "$OUT/results.json"
log "written $OUT/results.md, $OUT/results.json, logs in $LOGS"
