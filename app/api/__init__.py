"""The farm's HTTP API (FastAPI routers under /v1); `app.main.create_app` assembles it."""
