"""deepinfer: an asyncio LLM inference daemon, one process per node."""

__version__ = "0.1.0"
