"""The server-rendered web pages at `/` (include `app.web.router` in the app)."""

from qpcfarm.app.web import sweep_pages
from qpcfarm.app.web.routes import router

router.include_router(sweep_pages.router)

__all__ = ["router"]
