# One image for every kvflow Python service (migrate, materializer, router, inference nodes).
# TORCH_INDEX_URL picks the torch build: CPU by default; the compose `gpu` profile builds with a
# CUDA index instead.
# kvflow's compiled hot paths (native/, Rust: the materializer's planner, the adaptive policy's tables): a wheel, built apart so that the image
# carries no toolchain.
FROM python:3.11-slim AS native
RUN apt-get update \
 && apt-get install -y --no-install-recommends curl gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/* \
 && curl -sSf https://sh.rustup.rs | sh -s -- -y --profile minimal
ENV PATH=/root/.cargo/bin:$PATH
COPY native /native
RUN pip wheel --no-deps --wheel-dir /wheels /native

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
COPY --from=native /wheels /wheels
RUN pip install --no-deps . /wheels/*.whl \
 && rm -rf build *.egg-info /wheels

USER kvflow
ENV KVFLOW_ENV=production
ENTRYPOINT ["kvflow"]
CMD ["--help"]
