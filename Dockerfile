# qpcfarm: the API (`qpcfarm serve`) and, with another command, a compile worker
# (`qpcfarm worker`). docker-compose.yml runs both in farm mode (PostgreSQL + Redis).
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    QPCFARM_DATA_DIR=/var/lib/qpcfarm

WORKDIR /opt/qpcfarm
COPY pyproject.toml README.md alembic.ini ./
COPY compiler_core ./compiler_core
COPY app ./app
COPY worker ./worker
COPY migrations ./migrations
# Editable: `migrations/` and `alembic.ini` are found beside the packages (app.db.session
# looks for them in the source tree, which a plain wheel install would not ship).
RUN pip install -e ".[service]" \
    && useradd --system --uid 10001 --home-dir /var/lib/qpcfarm --shell /usr/sbin/nologin qpcfarm \
    && mkdir -p /var/lib/qpcfarm \
    && chown qpcfarm:qpcfarm /var/lib/qpcfarm

USER qpcfarm
WORKDIR /var/lib/qpcfarm
EXPOSE 8000

# Health checks are per role (API: GET /readyz; worker: `qpcfarm worker --ping`), so they
# live in docker-compose.yml rather than here.
CMD ["qpcfarm", "serve", "--host", "0.0.0.0", "--port", "8000"]
