# hookserve server image: `hookserve serve` as a non-root user, gRPC on 50051,
# Prometheus metrics on 9090, a HEALTHCHECK that asks the gRPC health service.
#
#   docker build -t hookserve .                                   # public registry + PyPI
#   docker build -t hookserve --build-arg WEIGHTS=imagenet .      # bake ImageNet weights
#   docker run --rm -p 50051:50051 -v $PWD/w:/weights:ro hookserve \
#       --model resnet18 --weights /weights/resnet18.pth
#   docker run --rm --gpus all -p 50051:50051 hookserve           # same image on a GPU
#   docker build -t hookserve-batch --build-arg EXTRAS=batch,s3 --build-arg TORCH_SPEC= .
#                                  # no torch: `hookserve batch` to/from S3 (the k8s Job)
#
# Written for Docker's legacy builder too (no BuildKit, so no RUN --mount).
# Offline builds: put wheels in deploy/wheels/ and pass --build-arg OFFLINE=1
# (scripts/docker_smoke.sh does this). docs/deploy.md explains every build argument.

# A Debian-based image with Python 3.10+ at python3; both stages must use the same one,
# because the virtual environment is copied across and points at its interpreter.
ARG BASE_IMAGE=python:3.11-slim

# ---------------------------------------------------------------------------- builder
FROM ${BASE_IMAGE} AS builder

# The default torch wheels on PyPI are CUDA builds that carry their own CUDA libraries,
# so one image serves CPU and GPU. For a much smaller CPU-only image pass e.g.
#   --build-arg TORCH_SPEC="torch==2.5.1+cpu torchvision==0.20.1+cpu"
#   --build-arg EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu
# Empty (--build-arg TORCH_SPEC=) installs no torch: a client image for `hookserve
# batch` and the SDK, with EXTRAS naming no server (e.g. EXTRAS=batch,s3).
ARG TORCH_SPEC="torch==2.14.1 torchvision==0.29.1"
# Non-empty: install from deploy/wheels only, with no package index at all.
ARG OFFLINE=""
# An extra package index, e.g. PyTorch's CPU-only one (see TORCH_SPEC).
ARG EXTRA_INDEX_URL=""

ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_FIND_LINKS=/wheels \
    PYTHONDONTWRITEBYTECODE=1

RUN python3 -m venv /opt/hookserve

# Local wheels, if any (the folder always exists; see deploy/wheels/README.md).
COPY deploy/wheels/ /wheels/

# Layer 1, the heavy one: torch and torchvision (none when TORCH_SPEC is empty).
# Depends only on TORCH_SPEC and the wheels, so editing code or pyproject.toml never
# reinstalls torch.
# SC2086 is ignored on purpose in this stage: $TORCH_SPEC and ${OFFLINE:+...} must
# word-split into several pip arguments (or into none at all).
# hadolint ignore=SC2086
RUN if [ -n "$TORCH_SPEC" ]; then \
      /opt/hookserve/bin/pip install ${OFFLINE:+--no-index} \
        ${EXTRA_INDEX_URL:+--extra-index-url "$EXTRA_INDEX_URL"} $TORCH_SPEC; \
    fi

# Layer 2: the other runtime dependencies, read from pyproject.toml: the core ones and
# those of EXTRAS, comma-separated (server: `hookserve serve`; batch: .h5/.parquet
# output for `hookserve batch`; s3, gcs: inputs and outputs on object stores).
ARG EXTRAS=server,batch
COPY pyproject.toml /src/pyproject.toml
# hadolint ignore=SC2086
RUN /opt/hookserve/bin/python -c "import sys, tomllib; p = tomllib.load(open('/src/pyproject.toml', 'rb'))['project']; print('\n'.join(p['dependencies'] + [r for e in sys.argv[1].split(',') for r in p['optional-dependencies'][e]]))" "$EXTRAS" > /src/requirements.txt \
 && /opt/hookserve/bin/pip install ${OFFLINE:+--no-index} -r /src/requirements.txt

# Layer 3: our code. --no-deps: everything it needs is installed above.
# (README.m[d]: the package metadata uses it when present; the build works without.)
COPY pyproject.toml README.m[d] /src/
COPY client /src/client
COPY service /src/service
# hadolint ignore=SC2086
RUN /opt/hookserve/bin/pip install ${OFFLINE:+--no-index} --no-deps /src \
 && /opt/hookserve/bin/hookserve serve --help > /dev/null

# ---------------------------------------------------------------------------- runtime
FROM ${BASE_IMAGE}

# none: no weights in the image (mount a state_dict, or a TORCH_HOME that holds them).
# imagenet: download torchvision's ImageNet weights for MODELS now, at build time
# (needs internet on the build machine). Start-up never downloads (HOOKSERVE_DOWNLOAD=0).
ARG WEIGHTS=none
# Comma-separated: the models served by default, and those baked for WEIGHTS=imagenet.
ARG MODELS=resnet50

# Fixed uid/gid 1000 so Kubernetes' runAsUser/fsGroup and mounted files can match it.
RUN groupadd --gid 1000 hookserve \
 && useradd --uid 1000 --gid 1000 --home-dir /home/hookserve --create-home \
      --shell /usr/sbin/nologin hookserve

COPY --from=builder /opt/hookserve /opt/hookserve

# Every `hookserve serve` flag has a HOOKSERVE_* variable; these are the image defaults.
# HOOKSERVE_WEIGHTS=imagenet with HOOKSERVE_DOWNLOAD=0: serve baked weights, or exit at
# once with a clear message when there are none - never a silent download or silent
# random weights. Pass --weights PATH (a mounted file) or --weights random to override.
# HOOKSERVE_HOST=[::]: `hookserve serve` listens on loopback unless told, and a
# container is reached from outside it, so the image listens on every interface (IPv4
# too). Without --auth-token-file or TLS the server logs a warning saying so.
ENV PATH=/opt/hookserve/bin:${PATH} \
    PYTHONUNBUFFERED=1 \
    TORCH_HOME=/opt/hookserve/torch \
    HOOKSERVE_MODEL=${MODELS} \
    HOOKSERVE_WEIGHTS=imagenet \
    HOOKSERVE_DOWNLOAD=0 \
    HOOKSERVE_HOST=[::] \
    HOOKSERVE_PORT=50051 \
    HOOKSERVE_METRICS_PORT=9090 \
    HOOKSERVE_METRICS_HOST=0.0.0.0 \
    HOOKSERVE_GRACE_SECONDS=30

# With WEIGHTS=imagenet, hookserve's own loader downloads and checks the files into
# $TORCH_HOME (readable by all, owned by root: the server cannot alter them).
RUN if [ "$WEIGHTS" = "imagenet" ]; then \
      python3 -c "import sys; from hookserve_server.models import build_model; [build_model(m, 'imagenet') for m in sys.argv[1].split(',')]" "$MODELS" \
      && chmod -R a+rX "$TORCH_HOME"; \
    elif [ "$WEIGHTS" != "none" ]; then \
      echo "WEIGHTS must be none or imagenet, not $WEIGHTS" >&2; exit 1; \
    fi

# Labels last: REVISION and CREATED change on every build, and anything after them
# would be rebuilt each time (here only metadata follows).
ARG VERSION=0.1.0
ARG REVISION=unknown
ARG CREATED=unknown
ARG BASE_IMAGE
LABEL org.opencontainers.image.title="hookserve" \
      org.opencontainers.image.description="gRPC service that turns a torchvision CNN into a remote feature extractor" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.base.name="${BASE_IMAGE}" \
      io.hookserve.weights="${WEIGHTS}" \
      io.hookserve.models="${MODELS}"

USER 1000:1000
WORKDIR /home/hookserve
# 8080: the Open Inference Protocol's REST routes, when HOOKSERVE_HTTP_PORT=8080 is set
# (build with EXTRAS including http; deploy/kserve runs it so).
EXPOSE 50051 9090 8080

# Asks grpc.health.v1 (open even with --auth-token-file). The start period covers model
# loading and warm-up; a server draining after SIGTERM reports NOT_SERVING -> unhealthy.
HEALTHCHECK --interval=15s --timeout=5s --start-period=120s --retries=3 \
  CMD ["sh", "-c", "exec hookserve health --server localhost:${HOOKSERVE_PORT} --timeout 4"]

# Python as PID 1 ignores SIGTERM unless handled: `hookserve serve` handles it and
# drains for HOOKSERVE_GRACE_SECONDS (keep `docker stop -t` / the pod's
# terminationGracePeriodSeconds above it).
STOPSIGNAL SIGTERM
ENTRYPOINT ["hookserve", "serve"]
