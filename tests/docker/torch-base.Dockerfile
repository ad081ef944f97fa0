# x1-local/torch-cpu: the trainer's base image for the Docker tests (TRAINER_BASE_IMAGE), standing
# in for NGC PyTorch where no registry is reachable: the Python base plus the CPU build of torch.
# Built by .ci/docker-base-images from a context holding this file, the torch wheel, the
# requirements beside it and the CA bundle pip needs behind a TLS-intercepting proxy.
ARG BASE_IMAGE=x1-local/python:3.11-bookworm
FROM ${BASE_IMAGE}

COPY ca.crt /tmp/x1-ca.crt
COPY requirements.txt /tmp/torch-base-requirements.txt
COPY torch-*.whl /tmp/
# The CA bundle serves this build only and is removed with the wheel.
RUN python -m pip install --no-cache-dir --cert /tmp/x1-ca.crt /tmp/torch-*.whl \
        -r /tmp/torch-base-requirements.txt \
    && python -m pip check \
    && rm -f /tmp/torch-*.whl /tmp/x1-ca.crt
CMD ["python3"]
