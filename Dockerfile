# The package with its gpu extra on the CPU build of torch, for docker-compose.yml.
# The base is pinned by its full version tag, not by digest: a digest can only be read
# from the registry (docker buildx imagetools inspect python:3.11.7-slim-bookworm), which
# the machines this file is checked on cannot reach. Pin it by digest where you build.
FROM python:3.11.7-slim-bookworm

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1

WORKDIR /src
COPY pyproject.toml setup.py README.md constraints.txt ./
COPY registry registry
COPY gpu gpu
COPY sim sim
COPY pcr pcr
COPY lua lua

# One index per pip call: torch (and its own dependencies) only from PyTorch's CPU index,
# then the package and everything else only from PyPI. constraints.txt holds torch at the
# version just installed, so the second call never fetches another torch.
RUN pip install --index-url https://download.pytorch.org/whl/cpu "torch==2.13.0" \
 && pip install --index-url https://pypi.org/simple -c constraints.txt \
        ".[gpu,embedded,hiredis,bridge,metrics,serve,gateway]" \
 && useradd --system --uid 10001 --user-group --no-create-home --shell /usr/sbin/nologin pcr

USER 10001:10001
WORKDIR /tmp

# The HTTP services' liveness: pcr serve's /live on 8000 by default; the compose file
# points the gateway at its /health (PCR_HEALTH_URL) and turns the check off for the
# simulation. Python, not curl: the slim image has no curl.
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen(os.environ.get('PCR_HEALTH_URL', 'http://127.0.0.1:8000/live'), timeout=4)"]

ENTRYPOINT []
CMD ["pcr", "--help"]
