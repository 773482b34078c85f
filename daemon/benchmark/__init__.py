"""Serving benchmarks: `deepinfer bench serve` and the seeded traffic traces it replays."""
