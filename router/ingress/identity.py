"""Who asks: a request's tenant and token class, whose jobs it sees, and the token a
request no route serves needs (with auth on, a stranger cannot map the routes)."""

from __future__ import annotations

from collections.abc import Mapping

from aiohttp import web

from router.config import TokenClass
from router.errors import Unauthorized
from router.ingress.auth import Authenticator
from router.ingress.relay import refused
from router.metrics import Metrics

#: the probes' and the scraper's paths: open with auth on
_OPEN = frozenset({"/health", "/ready", "/metrics"})


class Identity:
    """A request's identity from its headers, by the router's `Authenticator`."""

    def __init__(self, auth: Authenticator, tenant_header: str | None, metrics: Metrics) -> None:
        self.auth = auth
        self._tenant_header = tenant_header
        self._metrics = metrics

    def of(self, headers: Mapping[str, str]) -> tuple[str | None, TokenClass | None]:
        """The request's tenant (`tenant`) and its static token's class."""
        tenant, token_class = self.auth.identify(headers.get("Authorization"), self._claim(headers))
        if tenant is not None and self.auth.enabled:
            self._metrics.tenant_request(tenant, self.auth.tenants)
        return tenant, token_class

    def tenant(self, headers: Mapping[str, str]) -> str | None:
        """The request's tenant (`Authenticator.tenant`: with auth on, the token's, the
        tenant header's only when trusted). Raises Unauthorized for a missing or invalid
        token."""
        return self.of(headers)[0]

    def owner(self, headers: Mapping[str, str]) -> str | None:
        """Whose jobs, files and batches the request sees (`Authenticator.owner`)."""
        return self.auth.owner(headers.get("Authorization"), self._claim(headers))

    def _claim(self, headers: Mapping[str, str]) -> str | None:
        """The tenant the request claims in the tenant header, if one is configured."""
        return headers.get(self._tenant_header) if self._tenant_header else None

    @web.middleware
    async def unrouted(self, request: web.Request, handler) -> web.StreamResponse:
        """With auth on, a request no route serves (404, 405) needs a token as any
        other does, the probes' paths aside; the routes that serve check it themselves."""
        if (
            self.auth.enabled
            and request.match_info.http_exception is not None
            and request.path not in _OPEN
        ):
            try:
                self.auth.authenticate(request.headers.get("Authorization"))
            except Unauthorized as err:
                return await refused(request, err)
        return await handler(request)
