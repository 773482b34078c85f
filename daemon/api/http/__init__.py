"""The HTTP side of the API: server, middleware, state, routes, SSE, errors, and respond.py,
which answers every codec's call."""
