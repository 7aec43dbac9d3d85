"""The server-rendered web pages at `/` (include `app.web.router` in the app)."""

from app.web import sweep_pages
from app.web.routes import router

router.include_router(sweep_pages.router)

__all__ = ["router"]
