# fngate images. Targets:
#   gateway      `fngate gateway` on port 8000            docker build --target gateway -t fngate/gateway .
#   runner       `fngate runner`, onnxruntime on the CPU   docker build --target runner -t fngate/runner .
#   runner-gpu   `fngate runner` on CUDA with onnxruntime-gpu, from PyPI alone
#                                                          docker build --target runner-gpu -t fngate/runner-gpu .
#                and with TensorRT, whose libraries only NVIDIA's package index has (docs/gpu.md):
#                --build-arg TENSORRT=1 --build-arg TENSORRT_INDEX_URL=<NVIDIA's index URL>
# Every image is Debian 12 with Debian's Python 3.11 (BASE_IMAGE: scripts/images makes one from
# Debian's packages where no image registry is reachable), and a virtual environment in /opt/fngate
# installed from the lock (requirements/, made by scripts/lock) with every hash checked. Final stages
# hold neither pip nor apt, and run as the unprivileged user 10001. Each dependency layer copies its
# lock file alone, so that a change to the code or the README rebuilds the last, small layers only.
ARG BASE_IMAGE=debian:bookworm-slim

# ---------------------------------------------------------------- what every image runs on
#checkov:skip=CKV_DOCKER_7:BASE_IMAGE defaults to debian:bookworm-slim, a release tag; checkov cannot read an ARG.
FROM ${BASE_IMAGE} AS os
ENV DEBIAN_FRONTEND=noninteractive
# Debian's security updates replace package versions, so apt versions are not pinned; the base image
# tag is. ca-certificates: the trust store that rediss:// (ElastiCache) and S3 are verified against;
# the build fails here if Python finds no certificate in it. tini: the containers' PID 1 (below).
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install --yes --no-install-recommends python3 ca-certificates tini \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -c "import ssl; assert ssl.create_default_context().cert_store_stats()['x509_ca'] > 0, 'no CA certificates'" \
 && groupadd --system --gid 10001 fngate \
 && useradd --system --uid 10001 --gid fngate --home-dir /home/fngate --create-home --shell /usr/sbin/nologin fngate \
 && mkdir -p /var/cache/fngate \
 && chown fngate:fngate /var/cache/fngate

# ---------------------------------------------------------------- build: pip outside the environment
FROM os AS build
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install --yes --no-install-recommends python3-venv \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/pip \
 && python3 -m venv --without-pip /opt/fngate
# pip runs from /opt/pip and installs into /opt/fngate (PIP_PYTHON), which so never holds pip. A
# build behind a TLS-inspecting proxy passes the trust store that knows it as the secret
# ca-certificates (scripts/images: --secret id=ca-certificates,src=...); the RUN steps that
# download see it in place of the image's own, and no layer keeps it.
ENV PATH=/opt/pip/bin:$PATH \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    PIP_PYTHON=/opt/fngate/bin/python
WORKDIR /src

# fngate itself as a wheel, built by the locked build backend.
FROM build AS wheel
COPY requirements/build.txt /tmp/build.txt
RUN --mount=type=secret,id=ca-certificates,target=/etc/ssl/certs/ca-certificates.crt \
    env -u PIP_PYTHON pip install --require-hashes --no-deps -r /tmp/build.txt
COPY pyproject.toml README.md ./
COPY fngate ./fngate
COPY gateway ./gateway
COPY runner ./runner
RUN env -u PIP_PYTHON pip wheel --no-deps --no-build-isolation --wheel-dir /wheels .

# The gateway's dependencies; the runners' sets hold the same versions and add to them.
FROM build AS gateway-env
COPY requirements/gateway.txt /tmp/requirements.txt
RUN --mount=type=secret,id=ca-certificates,target=/etc/ssl/certs/ca-certificates.crt \
    pip install --require-hashes --no-deps -r /tmp/requirements.txt

FROM gateway-env AS runner-env
COPY requirements/runner.txt /tmp/requirements.txt
RUN --mount=type=secret,id=ca-certificates,target=/etc/ssl/certs/ca-certificates.crt \
    pip install --require-hashes --no-deps -r /tmp/requirements.txt

# Only the `gpu` extra: the CPU onnxruntime shares its import name with onnxruntime-gpu. CUDA and
# cuDNN come from their wheels (onnxruntime-gpu[cuda,cudnn]) and nowhere else; the driver is the
# node's, mounted by the NVIDIA container runtime. TensorRT (the `tensorrt` extra) only on request:
# its PyPI packages are stubs that download from NVIDIA's index, so a build without it says so.
FROM gateway-env AS gpu-env
ARG TENSORRT=0
ARG TENSORRT_INDEX_URL=""
COPY requirements/gpu.txt /tmp/requirements.txt
RUN --mount=type=secret,id=ca-certificates,target=/etc/ssl/certs/ca-certificates.crt \
    pip install --require-hashes --no-deps -r /tmp/requirements.txt
COPY --from=wheel /wheels /wheels
RUN --mount=type=secret,id=ca-certificates,target=/etc/ssl/certs/ca-certificates.crt \
    if [ "$TENSORRT" = 1 ] && [ -z "$TENSORRT_INDEX_URL" ]; then \
      echo "TENSORRT=1 needs NVIDIA's package index: --build-arg TENSORRT_INDEX_URL=<its URL> (docs/gpu.md)" >&2; \
      exit 1; \
    fi \
 && if [ "$TENSORRT" = 1 ]; then \
      pip install --extra-index-url "$TENSORRT_INDEX_URL" "$(echo /wheels/fngate-*.whl)[tensorrt]"; \
    else \
      echo "runner-gpu: without TensorRT (--build-arg TENSORRT=1 and TENSORRT_INDEX_URL add it)"; \
    fi

# ---------------------------------------------------------------- what the final images share
FROM os AS runtime
# No package manager in the final images: they never install anything.
#checkov:skip=CKV_DOCKER_9:apt here is the package purged from the final images, not the apt command line.
RUN dpkg --purge apt \
 && rm -rf /var/cache/apt /var/lib/apt
ENV PATH=/opt/fngate/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    XDG_CACHE_HOME=/var/cache/fngate
WORKDIR /home/fngate
# tini starts fngate and passes signals on. The kernel drops a signal a namespace's init has no
# handler for: as PID 1 itself, a runner stopped in its first seconds (before its imports are done
# and its handlers set, as when KEDA scales a Deployment made at one replica to zero) lost the
# SIGTERM and lingered out its whole grace period. In Kubernetes the rendered pods share their
# process namespace (fngate/k8s.py), so that neither is PID 1 there; -s: tini reaps what the
# backends leave whether it is PID 1 or not.
ENTRYPOINT ["tini", "-s", "--", "fngate"]

# ---------------------------------------------------------------- gateway
FROM gateway-env AS gateway-final-env
COPY --from=wheel /wheels /wheels
RUN pip install --no-deps /wheels/fngate-*.whl && pip check

FROM runtime AS gateway
COPY --from=gateway-final-env /opt/fngate /opt/fngate
ENV FNGATE_HOST=0.0.0.0 FNGATE_PORT=8000
# One port a line here follows fngate/k8s.py's GATEWAY_PORTS: HTTP, gRPC and metrics as Triton's.
EXPOSE 8000 8001 8002
USER 10001:10001
HEALTHCHECK --interval=15s --timeout=3s --start-period=10s --retries=3 \
  CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:%s/v2/health/live' % os.environ.get('FNGATE_PORT', '8000'), timeout=2)"]
CMD ["gateway"]

# ---------------------------------------------------------------- CPU runner
FROM runner-env AS runner-final-env
COPY --from=wheel /wheels /wheels
RUN pip install --no-deps /wheels/fngate-*.whl && pip check

FROM runtime AS runner
COPY --from=runner-final-env /opt/fngate /opt/fngate
# Model files go to the cache volume (the root filesystem is read-only), as the rendered objects say.
ENV FNGATE_ARTIFACT_DIR=/var/cache/fngate/artifacts
# 9100: metrics and health (fngate/k8s.py's RUNNER_PORTS); /healthz/ready answers while
# Redis does and the runner consumes.
EXPOSE 9100
USER 10001:10001
HEALTHCHECK --interval=15s --timeout=3s --start-period=60s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9100/healthz/ready', timeout=2)"]
CMD ["runner"]

# ---------------------------------------------------------------- GPU runner
FROM gpu-env AS gpu-final-env
RUN pip install --no-deps /wheels/fngate-*.whl && pip check

FROM runtime AS runner-gpu
RUN mkdir -p /var/cache/fngate/tensorrt \
 && chown fngate:fngate /var/cache/fngate/tensorrt
COPY --from=gpu-final-env /opt/fngate /opt/fngate
# TensorRT's libraries (when built in) come from its wheel; onnxruntime's TensorRT provider loads
# them by name, and the runner preloads CUDA and cuDNN from theirs (onnxruntime.preload_dlls). The
# device plugin sets NVIDIA_VISIBLE_DEVICES; the runtime mounts the driver for these capabilities.
# Built engines are cached on a volume so that a runner restart does not rebuild them.
ENV FNGATE_ARTIFACT_DIR=/var/cache/fngate/artifacts \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    LD_LIBRARY_PATH=/opt/fngate/lib/python3.11/site-packages/tensorrt_libs \
    FNGATE_ENGINE_CACHE_DIR=/var/cache/fngate/tensorrt
VOLUME ["/var/cache/fngate/tensorrt"]
EXPOSE 9100
USER 10001:10001
HEALTHCHECK --interval=15s --timeout=3s --start-period=120s --retries=3 \
  CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:9100/healthz/ready', timeout=2)"]
CMD ["runner"]
