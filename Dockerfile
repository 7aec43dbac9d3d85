# qpcfarm: the API (`qpcfarm serve`) and, with another command, a compile worker
# (`qpcfarm worker`). docker-compose.yml runs both in farm mode (PostgreSQL + Redis).
#
# Two stages: the first builds the wheel from the sources, the second installs that wheel (and
# its service extra) like any user would, so the image runs what `pip install` ships: the
# service as `app` / `worker` / `migrations`, the migrations with alembic.ini as package data.
FROM python:3.11-slim AS build

ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /src
COPY pyproject.toml README.md ./
COPY compiler_core ./compiler_core
COPY app ./app
COPY worker ./worker
COPY migrations ./migrations
RUN pip wheel --no-deps --wheel-dir /dist .

FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    QPCFARM_DATA_DIR=/var/lib/qpcfarm

COPY --from=build /dist /dist
RUN pip install "$(ls /dist/qpcfarm-*.whl)[service]" \
    && rm -rf /dist \
    && useradd --system --uid 10001 --home-dir /var/lib/qpcfarm --shell /usr/sbin/nologin qpcfarm \
    && mkdir -p /var/lib/qpcfarm \
    && chown qpcfarm:qpcfarm /var/lib/qpcfarm

USER qpcfarm
WORKDIR /var/lib/qpcfarm
EXPOSE 8000

# Health checks are per role (API: GET /readyz; worker: `qpcfarm worker --ping`), so they
# live in docker-compose.yml rather than here.
CMD ["qpcfarm", "serve", "--host", "0.0.0.0", "--port", "8000"]
