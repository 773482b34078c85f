"""MoE expert parallelism: expert placement, load statistics, live rebalancing, the lockstep
executor and the all-to-all exchanges of one MoE layer."""
