"""The models the engine drives (the interface in `base.py`), their KV caches and decode graphs,
and checkpoint loading."""
