"""What the HTTP server is set up with: address, limits, auth, protocol defaults."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    max_body_bytes: int = 8 * 1024 * 1024
    shutdown_timeout: float = 10.0  # seconds in-flight requests get to finish on SIGTERM
    api_key: str | None = None  # when set, requests need `Authorization: Bearer` or `x-api-key`
    admin_socket: str | None = None  # Unix socket for live administration (mode 0600)
    # the bearer token of the admin HTTP calls (POST /admin/v1/role); unset: no such routes.
    # A router sends it to its nodes when its autoscaler changes their role
    admin_token: str | None = None
    max_waiting: int = 0  # answer 429 once this many requests wait for the engine (0 = off)
    # DeepSeek-V4, a request that does not say whether to think: auto (Messages no, as
    # Anthropic's API; Chat Completions and Responses yes, as DeepSeek's) | on | off
    thinking_default: str = "auto"
    # the format of dense models' tool calls, as vLLM's --tool-call-parser:
    # auto (the one the chat template teaches) | hermes | llama3_json | none (no tools)
    tool_call_parser: str = "auto"
    # Responses kept for retrieval and `previous_response_id` (OpenAI's `store`), in host memory:
    # least recently used out past the count or the memory, dropped ttl seconds after last use
    response_store_max_count: int = 10_000  # 0 = keep none
    response_store_memory_gb: float = 0.5
    response_store_ttl_s: float = 3600.0
    # a vision model's images, per request: how many, encoded bytes (each, all), pixels each;
    # the URL schemes read (comma-separated: data, http, https; http(s) read the network)
    image_max_count: int = 8
    image_max_bytes: int = 10 * 2**20
    image_max_total_bytes: int = 32 * 2**20
    image_max_pixels: int = 4096 * 4096
    image_url_schemes: str = "data"
    image_fetch_timeout_s: float = 10.0
