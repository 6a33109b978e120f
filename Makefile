# hydrant's commands. `make run` serves the demo on the embedded store; `make test` runs what CI runs.
# Both install what they need on a fresh Debian machine (as root).

SHELL := /bin/bash
ORT_DIR := $(CURDIR)/.ort/lib
ORT_LIB := $(ORT_DIR)/libonnxruntime.so.1.31.1
export ORT_DYLIB_PATH ?= $(ORT_LIB)
CARGO ?= cargo
BIN := target/release/hydrant
DATA := data/hydrant.redb

.PHONY: run test ort ort-gpu check-gpu system-deps build demo-data lint fmt validate clean loadtest

# REDIS_URL=redis://HOST:PORT makes `run` (and `demo-data`) use that Redis instead of the embedded store.
REDIS_URL ?=
ifneq ($(REDIS_URL),)
export HYDRANT_STORE__REDIS__URL := $(REDIS_URL)
endif

## run: build, load the demo rows into the store, and serve on 127.0.0.1:8080
##   make run                                  # embedded store (data/hydrant.redb)
##   make run REDIS_URL=redis://127.0.0.1:6379 # Redis: rows loaded there with the bulk loader first
run: ort build demo-data
	$(BIN) serve

## test: format and lint checks, then every test (unit and integration, with a real redis-server)
test: system-deps ort
	$(CARGO) fmt --all --check
	$(CARGO) clippy --all-targets --workspace -- -D warnings
	$(CARGO) test --workspace --all-targets 2>&1 | tee target/test.log; exit $${PIPESTATUS[0]}

## loadtest: the compose topology as local processes (redis-server, seed, hydrant, loadtest) and a report
##   make loadtest SCENARIO=hot-path   (a name in loadtest/scenarios/ or a path to a .toml file)
SCENARIO ?= hot-path
loadtest: system-deps ort
	scripts/loadtest.sh $(if $(findstring .toml,$(SCENARIO)),$(SCENARIO),loadtest/scenarios/$(SCENARIO).toml)

## ort: the ONNX Runtime 1.31.1 CPU library, from the official onnxruntime wheel on PyPI
ort: $(ORT_LIB)
$(ORT_LIB):
	scripts/install-ort.sh cpu $(ORT_DIR)

## ort-gpu: the onnxruntime-gpu wheel's libraries instead (CUDA provider beside libonnxruntime.so)
ort-gpu:
	scripts/install-ort.sh gpu $(ORT_DIR)

## check-gpu: on a machine with an NVIDIA GPU, the CUDA tests and ranking on cpu vs cuda (scripts/check-gpu.sh)
check-gpu: system-deps ort-gpu
	scripts/check-gpu.sh

## system-deps: tools the tests start for real (redis-server; openssl makes the TLS test's certificates), installed from Debian when missing
system-deps:
	@command -v $(CARGO) >/dev/null || { echo "cargo not found: install Rust (https://rustup.rs) first" >&2; exit 1; }
	@command -v redis-server >/dev/null || { apt-get update -qq && apt-get install -y -qq redis-server >/dev/null; }
	@command -v openssl >/dev/null || { apt-get update -qq && apt-get install -y -qq openssl >/dev/null; }
	@command -v python3 >/dev/null || { apt-get update -qq && apt-get install -y -qq python3 python3-pip >/dev/null; }
	@command -v docker-compose >/dev/null || { apt-get update -qq && apt-get install -y -qq docker-compose >/dev/null; }
	@command -v iptables >/dev/null || { apt-get update -qq && apt-get install -y -qq iptables >/dev/null; }

build:
	@command -v $(CARGO) >/dev/null || { echo "cargo not found: install Rust (https://rustup.rs) first" >&2; exit 1; }
	$(CARGO) build --release --bin hydrant

## demo-data: (re)load the demo feature rows into the store (Redis when REDIS_URL is set)
demo-data: build
	$(BIN) load --view user_profile demo/rows/user_profile.jsonl
	$(BIN) load --view item_stats demo/rows/item_stats.jsonl

## validate: check the schemas and model bindings, as a data team's CI would
validate: ort build
	$(BIN) validate

lint:
	$(CARGO) fmt --all --check
	$(CARGO) clippy --all-targets --workspace -- -D warnings

fmt:
	$(CARGO) fmt --all

clean:
	rm -rf target data
