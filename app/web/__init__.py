"""The server-rendered web pages at `/` (include `app.web.router` in the app)."""

from qpcfarm.app.web.routes import router

__all__ = ["router"]
