"""MoE expert parallelism: expert placement, load statistics, live rebalancing and the lockstep
device worker. A layer below models (the V4 MoE layers use `ep.py`): imports nothing above."""
