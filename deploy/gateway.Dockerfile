# The SMG gateway image the compose `gateway` profile and deploy/k8s/smg.yaml run:
#   docker build -f deploy/gateway.Dockerfile -t llmsvc-gateway:1.13.0 .
# SMG is a Rust binary shipped in a Python wheel; the version is the test extra's, so the gateway
# deployed is the one the tests run in front of llmsvc. It needs no model: it fetches the
# tokenizer and chat template from a worker (VllmEngine/GetTokenizer) when it registers it.
ARG PYTHON_IMAGE=python:3.11-slim
FROM ${PYTHON_IMAGE} AS gateway
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1
RUN pip install smg==1.13.0
RUN useradd --create-home --uid 10001 smg
USER smg
EXPOSE 8000 29000
ENTRYPOINT ["smg"]
CMD ["launch", "--help"]
