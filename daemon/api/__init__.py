"""aiohttp routes, SSE streaming and protocol errors."""
