# The package with its gpu extra on the CPU build of torch, for docker-compose.yml.
FROM python:3.11-slim
WORKDIR /src
COPY pyproject.toml README.md ./
COPY registry registry
COPY gpu gpu
COPY sim sim
COPY pcr pcr
COPY lua lua
RUN pip install --no-cache-dir --extra-index-url https://download.pytorch.org/whl/cpu \
        "torch==2.13.0" ".[gpu,embedded,hiredis,bridge,metrics,serve,gateway]"
ENTRYPOINT []
CMD ["pcr", "--help"]
