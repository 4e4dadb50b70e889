# syntax=docker/dockerfile:1
# fngate images. Targets:
#   gateway      `fngate gateway` on port 8000            docker build --target gateway -t fngate/gateway .
#   runner       `fngate runner`, onnxruntime on the CPU   docker build --target runner -t fngate/runner .
#   runner-gpu   `fngate runner` on CUDA, with onnxruntime-gpu and TensorRT
#                                                          docker build --target runner-gpu -t fngate/runner-gpu .
# Each final stage holds a virtual environment in /opt/fngate and no compiler, pip or build files,
# and runs as the unprivileged user 10001. Dependencies are installed before the source is copied,
# so that a code change rebuilds one small layer and pulls no wheel again.

# The `gpu` extra pins the set that works together (docs/gpu.md): onnxruntime-gpu 1.31 is built for
# CUDA 13, and its TensorRT provider links TensorRT 10 (tensorrt-cu13). CUDA and cuDNN come from
# those wheels (onnxruntime-gpu[cuda,cudnn]) and nowhere else: the GPU base is plain Ubuntu, and the
# driver is the node's, mounted by the NVIDIA container runtime.
ARG ONNXRUNTIME_GPU_VERSION=1.31.1

# ---------------------------------------------------------------- CPU: build the environment
FROM python:3.12-slim-bookworm AS cpu-build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
# The dependencies (and the `cpu` extra) as pyproject.toml lists them, without the source.
RUN python -m venv /opt/fngate \
 && python -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; print('\n'.join(p['dependencies'] + p['optional-dependencies']['cpu']))" > requirements.txt \
 && /opt/fngate/bin/pip install --no-cache-dir -r requirements.txt
COPY fngate ./fngate
COPY gateway ./gateway
COPY runner ./runner
RUN /opt/fngate/bin/pip install --no-cache-dir --no-deps . \
 && /opt/fngate/bin/pip uninstall --yes pip

# ---------------------------------------------------------------- CPU: what both CPU images share
FROM python:3.12-slim-bookworm AS cpu-base
RUN groupadd --system --gid 10001 fngate \
 && useradd --system --uid 10001 --gid fngate --home-dir /home/fngate --create-home --shell /usr/sbin/nologin fngate \
 && mkdir -p /var/cache/fngate \
 && chown fngate:fngate /var/cache/fngate
COPY --from=cpu-build /opt/fngate /opt/fngate
ENV PATH=/opt/fngate/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    XDG_CACHE_HOME=/var/cache/fngate
WORKDIR /home/fngate
USER 10001:10001
ENTRYPOINT ["fngate"]

# ---------------------------------------------------------------- gateway
FROM cpu-base AS gateway
ENV FNGATE_HOST=0.0.0.0 FNGATE_PORT=8000
EXPOSE 8000
HEALTHCHECK --interval=15s --timeout=3s --start-period=10s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/v2/health/live' % os.environ.get('FNGATE_PORT', '8000'), timeout=2)"]
CMD ["gateway"]

# ---------------------------------------------------------------- CPU runner
FROM cpu-base AS runner
# 9100: metrics and health; /healthz/ready answers while Redis does and the runner consumes.
EXPOSE 9100
HEALTHCHECK --interval=15s --timeout=3s --start-period=60s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9100/healthz/ready', timeout=2)"]
CMD ["runner"]

# ---------------------------------------------------------------- GPU: build the environment
FROM ubuntu:24.04 AS gpu-build
ARG ONNXRUNTIME_GPU_VERSION
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 DEBIAN_FRONTEND=noninteractive
# Ubuntu's security updates replace package versions, so apt versions are not pinned; the base image tag is.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install --yes --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY pyproject.toml README.md ./
# Only the `gpu` extra: the CPU onnxruntime (the `cpu` extra) shares its import name with onnxruntime-gpu.
RUN python3 -m venv /opt/fngate \
 && python3 -c "import tomllib; p = tomllib.load(open('pyproject.toml', 'rb'))['project']; print('\n'.join(p['dependencies'] + p['optional-dependencies']['gpu']))" > requirements.txt \
 && /opt/fngate/bin/pip install --no-cache-dir -r requirements.txt "onnxruntime-gpu[cuda,cudnn]==${ONNXRUNTIME_GPU_VERSION}"
COPY fngate ./fngate
COPY gateway ./gateway
COPY runner ./runner
RUN /opt/fngate/bin/pip install --no-cache-dir --no-deps . \
 && /opt/fngate/bin/pip uninstall --yes pip

# ---------------------------------------------------------------- GPU runner
FROM ubuntu:24.04 AS runner-gpu
ENV DEBIAN_FRONTEND=noninteractive
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install --yes --no-install-recommends python3 \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --system --gid 10001 fngate \
 && useradd --system --uid 10001 --gid fngate --home-dir /home/fngate --create-home --shell /usr/sbin/nologin fngate \
 && mkdir -p /var/cache/fngate/tensorrt \
 && chown -R fngate:fngate /var/cache/fngate
COPY --from=gpu-build /opt/fngate /opt/fngate
# TensorRT's libraries come from its wheel; onnxruntime's TensorRT provider loads them by name, and
# the runner preloads CUDA and cuDNN from theirs (onnxruntime.preload_dlls). The device plugin sets
# NVIDIA_VISIBLE_DEVICES; the runtime mounts the driver for these capabilities. Built engines are
# cached on a volume so that a runner restart does not rebuild them.
ENV PATH=/opt/fngate/bin:$PATH \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    LD_LIBRARY_PATH=/opt/fngate/lib/python3.12/site-packages/tensorrt_libs \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    XDG_CACHE_HOME=/var/cache/fngate \
    FNGATE_ENGINE_CACHE_DIR=/var/cache/fngate/tensorrt
VOLUME ["/var/cache/fngate/tensorrt"]
WORKDIR /home/fngate
USER 10001:10001
EXPOSE 9100
HEALTHCHECK --interval=15s --timeout=3s --start-period=120s --retries=3 \
  CMD ["python3", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9100/healthz/ready', timeout=2)"]
ENTRYPOINT ["fngate"]
CMD ["runner"]
