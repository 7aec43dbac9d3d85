"""Security headers on every answer: the pages', the API's, the docs'.

- `Content-Security-Policy`: pages load scripts, styles and images from the farm only, no
  inline script (the pages' one script is a static file), no plugins, no framing, forms post
  only to the farm; inline `style` attributes are allowed (progress bars set their width) but
  not `<style>` elements. `/docs` and `/redoc` load Swagger UI / ReDoc from the farm too
  (`/docs/assets/`, no CDN) and start them from a static script or a tag; the viewers add
  `<style>` elements and ReDoc runs its search in a worker made from a `blob:` URL, so their
  policy allows inline styles and `blob:` workers, and nothing from another origin.
- `X-Frame-Options: DENY`, `X-Content-Type-Options: nosniff`, `Referrer-Policy: no-referrer`;
- `Strict-Transport-Security` when the request came over HTTPS.

A plain ASGI middleware: a few header tuples per answer, nothing else on the request path.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

PAGE_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; "
    "style-src-attr 'unsafe-inline'; img-src 'self' data:; connect-src 'self'; "
    "object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'self'"
)
DOCS_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; font-src 'self' data:; worker-src 'self' blob:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; frame-ancestors 'none'; "
    "form-action 'self'"
)
DOCS_PATHS = ("/docs", "/redoc")
HSTS = "max-age=31536000"

_COMMON = [
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
]


class SecurityHeaders:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope.get("path", "")
        csp = DOCS_CSP if path.startswith(DOCS_PATHS) else PAGE_CSP
        extra = [*_COMMON, (b"content-security-policy", csp.encode())]
        if scope.get("scheme") == "https":
            extra.append((b"strict-transport-security", HSTS.encode()))

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                present = {name.lower() for name, _ in message.get("headers", [])}
                headers = list(message.get("headers", []))
                headers += [(k, v) for k, v in extra if k not in present]
                message = {**message, "headers": headers}
            await send(message)

        await self.app(scope, receive, send_with_headers)
