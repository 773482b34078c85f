"""What to do when a prefix hit finds no sliding-window snapshot (DeepSeek-V4's SWA state)."""

from __future__ import annotations

# replay: recompute layers x (W-1) tokens before the boundary (exact state)
# window: the seed's bounded replay of the last W tokens (cheapest, approximate)
# exact:  resume from the last boundary whose window is stored, or from scratch
POLICIES = ("replay", "window", "exact")
