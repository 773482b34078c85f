"""Where a node's images are encoded: on the encoder nodes its settings name or its registries
list, else here."""

from __future__ import annotations

from daemon.build.images import RemoteEncoder
from daemon.cluster.config import ClusterConfig
from daemon.cluster.encoder_client import HttpImageEncoder
from daemon.loop.images import ImageEncoder
from daemon.models.base import VisionLanguageModel


def remote_encoder(cluster: ClusterConfig, api_key: str | None) -> RemoteEncoder | None:
    """None: the model's own tower on this node (no --image-encoders, no registry to ask).
    A node that registers over HTTP asks its registries (--peers) for encoder nodes."""
    urls = list(cluster.image_encoders)
    asks = cluster.role in ("unified", "prefill", "decode") and cluster.discovery == "http"
    registries = list(cluster.peers) if asks else []
    if not urls and not registries:
        return None

    def make(model: VisionLanguageModel, fingerprint: str, local: ImageEncoder) -> ImageEncoder:
        return HttpImageEncoder(
            urls,
            fingerprint,
            model.image_tokens,
            model.hidden_size,
            cluster.image_encode_timeout_s,
            api_key,
            registries=registries,
            fallback=local,
            refresh_s=cluster.lease_s,
        )

    return make
