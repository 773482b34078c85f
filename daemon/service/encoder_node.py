"""Where a node's images are encoded: on the encoder nodes its settings name, else here."""

from __future__ import annotations

from daemon.build.images import RemoteEncoder
from daemon.cluster.config import ClusterConfig
from daemon.cluster.encoder_client import HttpImageEncoder
from daemon.loop.images import ImageEncoder
from daemon.models.base import VisionLanguageModel


def remote_encoder(cluster: ClusterConfig, api_key: str | None) -> RemoteEncoder | None:
    """None: the model's own tower on this node (no --image-encoders)."""
    urls = list(cluster.image_encoders)
    if not urls:
        return None

    def make(model: VisionLanguageModel, fingerprint: str) -> ImageEncoder:
        return HttpImageEncoder(
            urls,
            fingerprint,
            model.image_tokens,
            model.hidden_size,
            cluster.image_encode_timeout_s,
            api_key,
        )

    return make
