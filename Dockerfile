# The X1 images: one common stage, then one stage per service. Build context is the repo root;
# compose.yaml names each service's stage (`target:`) and its build arguments:
#   docker compose build
#   docker build --target watchdog .                  # one image, with BuildKit
#   docker build --target trainer --build-arg X1_BASE=trainer-base \
#       --build-arg TRAINER_BASE_IMAGE=x1-local/torch-cpu:2.13.0 \
#       --build-arg TORCH_VERSION=2.13.0 --build-arg TORCH_CUDA=none .   # the CPU stand-in of the Docker tests
#
# The Python base is a build argument (compose: PYTHON_IMAGE); the default stays pinned. The
# trainer may start from a whole other base (TRAINER_BASE_IMAGE, e.g. one that already carries
# torch); its build passes X1_BASE=trainer-base so that the common stage starts there.
ARG PYTHON_IMAGE=python:3.11.11-slim-bookworm
ARG TRAINER_BASE_IMAGE=${PYTHON_IMAGE}
ARG X1_BASE=python

FROM ${PYTHON_IMAGE} AS python
FROM ${TRAINER_BASE_IMAGE} AS trainer-base

# ---- common: what every X1 image starts with --------------------------------------------------
FROM ${X1_BASE} AS common
# bash with pipefail in every stage over this one (hadolint, reading stage by stage, asks again: DL4006).
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Every X1 service runs as uid 1000: they share the /workspace volume, and a fresh named volume
# takes the ownership of the image's /workspace. A base that has a uid 1000 already keeps it.
RUN (getent group 1000 >/dev/null || groupadd --gid 1000 x1) \
    && (getent passwd 1000 >/dev/null || useradd --uid 1000 --gid 1000 --create-home --shell /usr/sbin/nologin x1) \
    && mkdir -p /workspace \
    && chown 1000:1000 /workspace
WORKDIR /opt/x1

# ---- package: the X1 wheel, which every image installs without its dependencies ---------------
# Each image pins those itself (its requirements.txt), first: that layer survives code changes.
# pyproject.toml names all five packages, so all five small source folders come along. A CA bundle
# for pip behind a TLS-intercepting proxy comes as the BuildKit secret `build-ca`
# (compose.build-ca.yaml): mounted for the install steps only, never stored in a layer.
FROM common AS package
COPY pyproject.toml README.md ./
COPY x1_common x1_common
COPY trainer/x1_pretrain trainer/x1_pretrain
COPY budget-sidecar/budget_sidecar budget-sidecar/budget_sidecar
COPY watchdog/x1_watchdog watchdog/x1_watchdog
COPY launcher/x1_launch launcher/x1_launch
RUN --mount=type=secret,id=build-ca \
    if [ -s /run/secrets/build-ca ]; then export PIP_CERT=/run/secrets/build-ca; fi \
    && python -m pip wheel --no-cache-dir --no-deps --wheel-dir /wheels .

# ---- trainer (and the one-shot `prepare` step) ------------------------------------------------
# torch 2.11.0 with CUDA 13.0 from PyPI on a plain Python base, plus the X1 package and its
# `trainer` extra.
#
# Why this base and not NVIDIA's PyTorch image: every GPU figure in docs/PERFORMANCE.md was measured
# on torch 2.11.0+cu130 (Triton 3.6), and the trainer's tuned step uses calls newer than older
# images carry (NGC 24.10 ships torch 2.5, where the first backward failed). NGC images carry
# NVIDIA's own pre-release builds (2.x.0a0+...), never a release, so no NGC tag is the measured
# torch. PyPI's torch 2.11.0 wheel is exactly the measured build: CUDA 13.0 runtime, cuBLAS, cuDNN
# 9.19, NCCL 2.28 and Triton 3.6 come as its pinned dependency wheels (measured: a 4.8 GB layer,
# 2.7 GB of it NVIDIA's libraries, 1.2 GB torch, 0.6 GB Triton; the whole image 5.9 GB, built in
# ~5 min from PyPI), so the base needs no CUDA of its own; the host needs only the NVIDIA driver
# (CUDA 13 needs the R580 branch or newer; docs/DEPLOY.md, host checks).
# TORCH_VERSION and TORCH_CUDA are what the build must end with: the check after the install fails
# the build when anything else is installed (a base with another torch, a requirement that swapped
# it). A base that already carries torch at TORCH_VERSION keeps it (the CPU stand-in: TORCH_CUDA=none).
FROM common AS trainer
ARG TORCH_VERSION=2.11.0
ARG TORCH_CUDA=13.0

# gcc and libc6-dev: Triton compiles a small C launcher for each kernel with the system compiler
# the first time it runs (the loss, RoPE and SwiGLU kernels, and torch.compile's own). The GPU
# needs no privilege: the NVIDIA runtime opens the devices to the container.
RUN apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*

# torch first (its own layer: 4.5 GB that changes only with the pin), then the pinned requirements
# with torch held at what is installed, then the check.
COPY --chmod=0755 trainer/torch_pin.py /usr/local/bin/x1-torch-pin
RUN --mount=type=secret,id=build-ca \
    if [ -s /run/secrets/build-ca ]; then export PIP_CERT=/run/secrets/build-ca; fi \
    && python -m pip install --no-cache-dir "torch==${TORCH_VERSION}" \
    && python /usr/local/bin/x1-torch-pin --version "${TORCH_VERSION}" --cuda "${TORCH_CUDA}"
COPY trainer/requirements.txt /tmp/requirements.txt
# hadolint ignore=DL4006
RUN --mount=type=secret,id=build-ca \
    if [ -s /run/secrets/build-ca ]; then export PIP_CERT=/run/secrets/build-ca; fi \
    && python -m pip list --format=freeze | grep -iE '^torch==' > /tmp/x1-keep.txt \
    && python -m pip install --no-cache-dir -r /tmp/requirements.txt -c /tmp/x1-keep.txt \
    && python /usr/local/bin/x1-torch-pin --version "${TORCH_VERSION}" --cuda "${TORCH_CUDA}"

# float8 training (train.float8) needs torchao (for torch >= 2.11): opt-in, since at the 50M model's
# width it measured slower (--build-arg FLOAT8=1; compose: TRAINER_FLOAT8=1).
ARG FLOAT8=0
COPY trainer/requirements-float8.txt /tmp/requirements-float8.txt
RUN --mount=type=secret,id=build-ca \
    if [ -s /run/secrets/build-ca ]; then export PIP_CERT=/run/secrets/build-ca; fi \
    && if [ "$FLOAT8" = 1 ]; then \
        python -m pip install --no-cache-dir -r /tmp/requirements-float8.txt -c /tmp/x1-keep.txt \
        && python /usr/local/bin/x1-torch-pin --version "${TORCH_VERSION}" --cuda "${TORCH_CUDA}"; \
    fi

RUN --mount=type=bind,from=package,source=/wheels,target=/tmp/wheels \
    python -m pip install --no-cache-dir --no-deps /tmp/wheels/*.whl
COPY configs configs
COPY --chmod=0755 trainer/entrypoint.sh /usr/local/bin/x1-train

USER 1000:1000
# The working directory stays /opt/x1 so that `--config configs/x1-50m-a100.yaml` resolves.
CMD ["x1-train", "--help"]

# ---- budget-sidecar ---------------------------------------------------------------------------
# Polls the provider's billing API every few minutes, writes /workspace/budget.json atomically,
# serves /budget, /healthz and /metrics.
FROM common AS budget-sidecar
COPY budget-sidecar/requirements.txt /tmp/requirements.txt
RUN --mount=type=secret,id=build-ca \
    if [ -s /run/secrets/build-ca ]; then export PIP_CERT=/run/secrets/build-ca; fi \
    && python -m pip install --no-cache-dir -r /tmp/requirements.txt && python -m pip check
RUN --mount=type=bind,from=package,source=/wheels,target=/tmp/wheels \
    python -m pip install --no-cache-dir --no-deps /tmp/wheels/*.whl

USER 1000:1000
WORKDIR /workspace
EXPOSE 9792
# compose.yaml gives the full command line; alone, the image shows the usage.
CMD ["python", "-m", "budget_sidecar", "--help"]

# ---- watchdog ---------------------------------------------------------------------------------
# Supervises the trainer container through the Docker Engine API (docker mode) and relaunches it
# after a preemption, crash or stall; serves /metrics. It reaches /var/run/docker.sock through the
# socket's group, which compose adds at run time (group_add: DOCKER_GID): the gid differs from host
# to host, so it cannot be baked in here. Access to that socket is root-equivalent on the host.
FROM common AS watchdog
COPY watchdog/requirements.txt /tmp/requirements.txt
RUN --mount=type=secret,id=build-ca \
    if [ -s /run/secrets/build-ca ]; then export PIP_CERT=/run/secrets/build-ca; fi \
    && python -m pip install --no-cache-dir -r /tmp/requirements.txt && python -m pip check
RUN --mount=type=bind,from=package,source=/wheels,target=/tmp/wheels \
    python -m pip install --no-cache-dir --no-deps /tmp/wheels/*.whl

USER 1000:1000
WORKDIR /workspace
EXPOSE 9793
# compose.yaml gives the full command line; alone, the image shows the usage.
CMD ["python", "-m", "x1_watchdog", "--help"]

# ---- mlflow-server ----------------------------------------------------------------------------
# The MLflow tracking server, sqlite backend and proxied artifacts under /workspace/mlruns. No X1
# code runs here. MLflow 3's background job runner (GenAI jobs) is unused here and costs seven
# ~200 MB processes.
FROM common AS mlflow-server
ENV MLFLOW_SERVER_ENABLE_JOB_EXECUTION=false
RUN mkdir -p /workspace/mlruns \
    && chown -R 1000:1000 /workspace
COPY mlflow-server/requirements.txt /tmp/requirements.txt
RUN --mount=type=secret,id=build-ca \
    if [ -s /run/secrets/build-ca ]; then export PIP_CERT=/run/secrets/build-ca; fi \
    && python -m pip install --no-cache-dir -r /tmp/requirements.txt && python -m pip check

USER 1000:1000
WORKDIR /workspace
EXPOSE 5000
# compose.yaml gives the full command line; these defaults serve the same store for `docker run`.
CMD ["mlflow", "server", "--backend-store-uri", "sqlite:////workspace/mlruns/mlflow.db", \
     "--artifacts-destination", "/workspace/mlruns/artifacts", \
     "--host", "0.0.0.0", "--port", "5000", "--workers", "2"]
