"""The server-rendered web pages at `/` (include `app.web.router` in the app)."""

from app.web.routes import router

__all__ = ["router"]
