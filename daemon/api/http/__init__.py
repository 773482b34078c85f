"""The HTTP side of the API: server, middleware, state, routes, SSE, errors."""
