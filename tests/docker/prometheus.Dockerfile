# x1-local/prometheus-debian: stands in for prom/prometheus in the Docker tests, where no image
# registry is reachable: Debian bookworm's own `prometheus` package, run as prom/prometheus runs
# (ENTRYPOINT the server, compose's command its flags, data in /prometheus, wget for compose's
# healthcheck). Build context: tests/docker.
ARG BASE_IMAGE=x1-local/python:3.11-bookworm
FROM ${BASE_IMAGE}

# hadolint ignore=DL3008
RUN apt-get update \
    && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus wget \
    && rm -rf /var/lib/apt/lists/* \
    && mkdir -p /prometheus \
    && chown prometheus:prometheus /prometheus

USER prometheus
WORKDIR /prometheus
EXPOSE 9090
ENTRYPOINT ["/usr/bin/prometheus"]
CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]
