# One image for every kvflow Python service (migrate, materializer, router, inference nodes).
# TORCH_INDEX_URL picks the torch build: CPU by default; the compose `gpu` profile builds with a
# CUDA index instead.
FROM python:3.11-slim AS base

ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1

RUN apt-get update \
 && apt-get install -y --no-install-recommends curl \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --create-home --uid 10001 kvflow

WORKDIR /app
# Dependencies first, for layer caching.
COPY pyproject.toml README.md ./
RUN pip install --index-url "$TORCH_INDEX_URL" torch \
 && mkdir -p kvflow && touch kvflow/__init__.py \
 && pip install . && pip uninstall -y kvflow && rm -rf kvflow

COPY . .
RUN pip install --no-deps . \
 && rm -rf build *.egg-info

USER kvflow
ENV KVFLOW_ENV=production
ENTRYPOINT ["kvflow"]
CMD ["--help"]
