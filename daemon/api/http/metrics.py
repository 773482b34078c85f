"""GET /metrics: the Prometheus text exposition of the daemon's metrics."""

from __future__ import annotations

from collections.abc import Iterator

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.core import CounterMetricFamily, Metric

from daemon.api.codecs.images import ImageReader
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


class ImagesPreprocessed:
    """The images this node decoded and preprocessed (for its own vision tower: none for those
    an encoder node encodes, or whose embeddings were cached), read from the reader at scrape
    time."""

    def __init__(self, reader: ImageReader, registry: CollectorRegistry) -> None:
        self.reader = reader
        registry.register(self)

    def collect(self) -> Iterator[Metric]:
        yield CounterMetricFamily(
            "deepinfer:images_preprocessed",
            "Images decoded and preprocessed for this node's vision tower.",
            value=self.reader.preprocessed,
        )


@routes.get("/metrics")
async def metrics(request: web.Request) -> web.Response:
    body = generate_latest(get_state(request).metrics.registry)
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def register(app: web.Application) -> None:
    app.router.add_routes(routes)
