"""MoE expert placement, load statistics and rebalancing (arrives with the MoE issue)."""
