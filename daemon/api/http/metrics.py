"""GET /metrics: the Prometheus text exposition of the daemon's metrics."""

from __future__ import annotations

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest

from daemon.api.http.state import get_state

routes = web.RouteTableDef()


class HttpErrors:
    """The answered errors, by status and type, in the registry /metrics serves."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.errors = Counter(
            "deepinfer:http_errors",
            "Error responses by status and type.",
            ["status", "type"],
            registry=registry,
        )

    def on_error(self, status: int, kind: str) -> None:
        self.errors.labels(str(status), kind).inc()


@routes.get("/metrics")
async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(get_state(request).metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def register(app: web.Application) -> None:
    app.router.add_routes(routes)
