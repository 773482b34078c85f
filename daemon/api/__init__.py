"""The API: `http` (the aiohttp server, middleware, routes, SSE, errors) above `codecs` (protocol
bodies -> engine requests, engine outputs -> protocol answers)."""
