# The "instance" of tests/test_launch*.py: what a RunPod pod or a Lambda VM is to `x1 launch`, as
# a container on a test network. Debian's openssh-server, the Python packages the stack needs
# (the project's extras, then the project itself uninstalled: the stack that runs is the copy
# `x1 launch` puts on the instance), and a tokenized corpus on its volume (the standard
# library's docstrings: `prepare` downloads from the Hugging Face hub, which the tests cannot).
# Built once per test session from the repo root:
#   DOCKER_BUILDKIT=1 docker build -f tests/docker/instance.Dockerfile --secret id=build-ca,src=CA.crt .
ARG BASE_IMAGE=x1-local/torch-cpu:2.13.0
FROM ${BASE_IMAGE}

SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# Host keys are made at the container's first start (/start.sh), so no two instances share one.
RUN apt-get update -qq \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends openssh-server procps \
    && rm -rf /var/lib/apt/lists/* /etc/ssh/ssh_host_* \
    && mkdir -p /run/sshd

# The extras' packages, from pyproject.toml alone (an empty README and the empty package folders
# its [tool.setuptools] lists stand in for the sources, so this layer is rebuilt only when
# pyproject.toml changes); then the project is uninstalled.
WORKDIR /opt/x1-build
COPY pyproject.toml ./
RUN --mount=type=secret,id=build-ca \
    if [ -s /run/secrets/build-ca ]; then export PIP_CERT=/run/secrets/build-ca; fi \
    && touch README.md \
    && python -c 'import pathlib, tomllib; t = tomllib.load(open("pyproject.toml", "rb"))["tool"]["setuptools"]; \
        d = [pathlib.Path(t["package-dir"][p.split(".")[0]], *p.split(".")[1:]) for p in t["packages"]]; \
        [(f.mkdir(parents=True, exist_ok=True), (f / "__init__.py").touch()) for f in d]' \
    && python -m pip list --format=freeze | grep -iE '^(torch|numpy)==' > /tmp/x1-keep.txt \
    && python -m pip install --no-cache-dir -q '.[trainer,sidecar,watchdog,mlflow]' -c /tmp/x1-keep.txt \
    && python -m pip uninstall -y -q x1 \
    && rm -rf /opt/x1-build
WORKDIR /
# The corpus on the instance's volume, tokenized by the project's own tools (from a copy used here only).
COPY x1_common /tmp/x1/x1_common
COPY trainer/x1_pretrain /tmp/x1/trainer/x1_pretrain
RUN PYTHONPATH=/tmp/x1:/tmp/x1/trainer python -m x1_pretrain.corpus stdlib-docstrings --output /tmp/corpus --max-mb 1 \
    && PYTHONPATH=/tmp/x1:/tmp/x1/trainer python -m x1_pretrain.tokenize_data --input-dir /tmp/corpus \
        --output-dir /workspace/ws/data/tokenized --tokenizer gpt2 --val-fraction 0.02 --workers 2 --seed 42 \
    && rm -rf /tmp/corpus /tmp/x1 \
    && ! python -c 'import x1_pretrain' 2>/dev/null
COPY --chmod=0755 tests/docker/instance/start.sh /start.sh
CMD ["/start.sh"]
