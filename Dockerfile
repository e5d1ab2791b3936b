# syntax=docker/dockerfile:1
# The cpn image. Its entry point is `cpn`; a container's args are the subcommand:
#   serve --host 0.0.0.0 --port 8000   |   db upgrade   |   agent --cluster ... --controller ...
# The Helm chart in helm/cpn runs exactly these. Build:
#   docker build -t cpn:0.1.0 .
# CUDA wheels of torch bring their own CUDA libraries (the host only needs the NVIDIA driver):
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 -t cpn:0.1.0-cu128 .
# BASE_IMAGE may be another Debian/Ubuntu image with Python 3.11 or 3.12 as `python3`
# (e.g. a CUDA base for custom kernels); both stages use it so the virtualenv fits.

ARG BASE_IMAGE=python:3.11-slim-bookworm

FROM ${BASE_IMAGE} AS build
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG TORCH_VERSION=2.13.0
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python3 -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
# torch first, from its own index: the default index would pull the CUDA build.
RUN pip install --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"
WORKDIR /src
COPY pyproject.toml constraints.txt README.md ./
COPY api ./api
COPY controller ./controller
COPY scheduler ./scheduler
COPY agents ./agents
COPY training ./training
COPY migrations ./migrations
COPY grammar ./grammar
COPY testbed ./testbed
COPY wire ./wire
RUN pip install -c constraints.txt '.[server,s3]' \
 && python -c "import torch; assert torch.__version__.split('+')[0] == '${TORCH_VERSION}', torch.__version__"

FROM ${BASE_IMAGE} AS runtime
# wget: KubeRay's default health probes of Ray nodes call it.
RUN apt-get update \
 && apt-get install -y --no-install-recommends wget \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 10001 cpn \
 && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/cpn --shell /bin/bash cpn \
 && mkdir -p /data \
 && chown 10001:10001 /data
COPY --from=build /opt/venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    CPN_DATABASE_URL=sqlite:////data/cpn.db
WORKDIR /home/cpn
# Numeric, so Kubernetes can verify runAsNonRoot; the chart runs as the same uid.
USER 10001:10001
VOLUME ["/data"]
EXPOSE 8000 9100
ENTRYPOINT ["cpn"]
CMD ["--help"]
