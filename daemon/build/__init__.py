"""Assembling an engine from its settings: checkpoint, device, KV memory, MoE."""
