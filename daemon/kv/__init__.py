"""KV memory: spec kinds and their managers, block pools and tables, and the prefix cache
with its tiers (host memory, block store, sliding-window snapshots)."""
