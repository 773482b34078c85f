"""KV memory: per-layer KV specs, the paged block pool and per-request block tables."""
