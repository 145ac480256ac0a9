# The image of one kvflow service: KVFLOW_EXTRA names the extras it installs (pyproject.toml,
# README.md "Installing one service"; comma-separated): `db` for the migration job, `kafka` for the
# topic set-up, `materializer`, `router`, `node`, `bridge`; `all` (the default) for every service.
# Only images whose extras need torch install it (`node`, `bench`, `all`, `test`), from
# TORCH_INDEX_URL: the CPU build by default; the compose `gpu` profile builds with a CUDA index.
#
#   docker build --build-arg KVFLOW_EXTRA=router -t kvflow:router .

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

ARG KVFLOW_EXTRA=all
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1

RUN apt-get update \
 && apt-get install -y --no-install-recommends curl \
 && rm -rf /var/lib/apt/lists/* \
 && useradd --system --create-home --uid 10001 kvflow

WORKDIR /app
# Dependencies first, for layer caching: torch from its own index where an extra needs it (pip
# then keeps that build), then the extras' requirements from PyPI.
COPY pyproject.toml README.md ./
RUN for extra in $(echo "$KVFLOW_EXTRA" | tr ',' ' '); do \
      case "$extra" in node|bench|all|test) needs_torch=1 ;; esac; \
    done \
 && if [ -n "${needs_torch:-}" ]; then pip install --index-url "$TORCH_INDEX_URL" torch; fi \
 && mkdir -p kvflow && touch kvflow/__init__.py \
 && pip install ".[$KVFLOW_EXTRA]" && pip uninstall -y kvflow && rm -rf kvflow

COPY . .
COPY --from=native /wheels /wheels
RUN pip install --no-deps . /wheels/*.whl \
 && rm -rf build *.egg-info /wheels \
 && mkdir -p /models && chown kvflow /models

USER kvflow
ENV KVFLOW_ENV=production
ENTRYPOINT ["kvflow"]
CMD ["--help"]
