"""Settings of one daemon instance: a TOML file, overridden by DEEPINFER_<SECTION>_<KEY>
environment variables, overridden by command-line flags; checked before anything starts.

    [engine]   EngineConfig (build.config)      [server]   ServerConfig (api.http.config)
    [logging]  LogConfig (service.logs)         [cluster]  ClusterConfig (cluster.config)
"""

from __future__ import annotations

import dataclasses
import difflib
import tomllib
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from daemon.api.codecs.images import SCHEMES as IMAGE_SCHEMES
from daemon.api.codecs.recipe.codec import THINKING_DEFAULTS
from daemon.api.codecs.tool_parsers import PARSERS
from daemon.api.http.config import ServerConfig
from daemon.build.config import DEMOS, DEVICES, DTYPES, EngineConfig
from daemon.cluster.config import (
    NODE_ID,
    ClusterConfig,
    autoscale_targets,
    base_url,
    etcd_endpoint,
)
from daemon.cluster.node import ROLES
from daemon.kv.swa_policy import POLICIES
from daemon.kv.traffic import TrafficClasses
from daemon.loop.spec.drafters import DRAFTERS
from daemon.loop.spec.policy import POLICIES as SPEC_POLICIES
from daemon.service import logs

EXIT_INVALID_SETTINGS = 2  # systemd does not restart it (RestartPreventExitStatus)
# auto: the format the chat template teaches; none: no tool calls (api.codecs.chat_template)
TOOL_CALL_PARSERS = ("auto", "none", *PARSERS)


@dataclass
class Settings:
    engine: EngineConfig = field(default_factory=EngineConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    logging: logs.LogConfig = field(default_factory=logs.LogConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)


SECTIONS: dict[str, type] = {
    "engine": EngineConfig,
    "server": ServerConfig,
    "logging": logs.LogConfig,
    "cluster": ClusterConfig,
}
_WILDCARDS = ("0.0.0.0", "::", "")
_TRUE, _FALSE = {"1", "true", "yes", "on"}, {"0", "false", "no", "off"}


class ConfigError(ValueError):
    def __init__(self, key: str, message: str, source: str = "") -> None:
        self.key = key
        where = f" ({source})" if source else ""
        super().__init__(f"{key}: {message}{where}")


def load_settings(
    path: str | Path | None = None,
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, Mapping[str, Any]] | None = None,
    base: Mapping[str, Mapping[str, Any]] | None = None,
) -> Settings:
    """`base` (a command's own defaults), the file, the environment, then `overrides`
    ({section: {key: value}}); then checked."""
    values: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    _merge(values, {k: dict(v) for k, v in (base or {}).items()}, "defaults")
    if path is not None:
        _merge(values, _read_toml(Path(path)), str(path))
    _merge(values, _from_env(env or {}), "environment")
    _merge(values, {k: dict(v) for k, v in (overrides or {}).items()}, "command line")
    settings = Settings(**{name: SECTIONS[name](**values[name]) for name in SECTIONS})
    check(settings)
    return settings


def _read_toml(path: Path) -> dict[str, Any]:
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except OSError as e:
        raise ConfigError(str(path), f"cannot read the file: {e.strerror}") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(str(path), f"not valid TOML: {e}") from None


def _fields(section: str) -> dict[str, Any]:
    cls = SECTIONS[section]
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _merge(values: dict[str, dict[str, Any]], new: dict[str, Any], source: str) -> None:
    for section, table in new.items():
        if section not in SECTIONS:
            raise ConfigError(section, f"unknown section{_suggest(section, SECTIONS)}", source)
        if not isinstance(table, dict):
            raise ConfigError(section, "must be a table ([section])", source)
        fields = _fields(section)
        for key, value in table.items():
            name = f"{section}.{key}"
            if key not in fields:
                raise ConfigError(name, f"unknown key{_suggest(key, fields)}", source)
            values[section][key] = _typed(name, value, fields[key], source)


def _suggest(word: str, options: Mapping[str, Any]) -> str:
    close = difflib.get_close_matches(word, list(options), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _typed(name: str, value: Any, hint: Any, source: str) -> Any:
    """`value` checked against the field's type (None allowed only for optional fields)."""
    args = typing.get_args(hint)
    optional = type(None) in args
    base = next((a for a in args if a is not type(None)), hint) if optional else hint
    if value is None:
        if optional:
            return None
        raise ConfigError(name, "must be set", source)
    origin = typing.get_origin(base)
    if origin is list:
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            raise ConfigError(name, "must be a list of strings", source)
        return list(value)
    if base is bool:
        ok = isinstance(value, bool)
    elif base is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif base is float:
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        value = float(value) if ok else value
    else:
        ok = isinstance(value, base)
    if not ok:
        raise ConfigError(name, f"must be {base.__name__}, got {type(value).__name__}", source)
    return value


def _from_env(env: Mapping[str, str]) -> dict[str, dict[str, Any]]:
    """DEEPINFER_ENGINE_KV_CACHE_MEMORY_GB=8 -> {"engine": {"kv_cache_memory_gb": 8.0}}."""
    out: dict[str, dict[str, Any]] = {}
    for section in SECTIONS:
        prefix = f"DEEPINFER_{section.upper()}_"
        for var, text in env.items():
            if not var.startswith(prefix):
                continue
            key = var[len(prefix) :].lower()
            hint = _fields(section).get(key)
            if hint is None:
                raise ConfigError(
                    var, f"unknown setting{_suggest(key, _fields(section))}", "environment"
                )
            out.setdefault(section, {})[key] = _parse_text(var, text, hint)
    return out


def _parse_text(name: str, text: str, hint: Any) -> Any:
    args = typing.get_args(hint)
    # list[str]'s args are its items' type: only an optional's are unwrapped
    base = next((a for a in args if a is not type(None)), hint) if type(None) in args else hint
    if typing.get_origin(base) is list:
        return [t.strip() for t in text.split(",") if t.strip()]
    if type(None) in args and text == "":
        return None
    try:
        if base is bool:
            if text.lower() not in _TRUE | _FALSE:
                raise ValueError
            return text.lower() in _TRUE
        if base in (int, float):
            return base(text)
    except ValueError:
        raise ConfigError(name, f"{text!r} is not a {base.__name__}", "environment") from None
    return text


def check(s: Settings) -> None:
    """Values each setting can take, and how settings must agree with each other."""
    e, sv, lg = s.engine, s.server, s.logging
    _choice("engine.device", e.device, DEVICES)
    _choice("engine.dtype", e.dtype, DTYPES)
    if e.demo is not None:
        _choice("engine.demo", e.demo, DEMOS)
        if e.model:
            raise ConfigError("engine.demo", "a built-in demo is served only without a model")
    _choice("engine.swa_miss_policy", e.swa_miss_policy, POLICIES)
    if e.speculative is not None:
        _choice("engine.speculative", e.speculative, tuple(DRAFTERS))
    _choice("engine.spec_policy", e.spec_policy, SPEC_POLICIES)
    if e.num_speculative_tokens < 1:
        raise ConfigError("engine.num_speculative_tokens", "must be at least 1")
    if not e.spec_min_gain >= 0:
        raise ConfigError("engine.spec_min_gain", "must be >= 0")
    if e.draft_layers < 0:
        raise ConfigError("engine.draft_layers", "must be >= 0 (0: half the model's layers)")
    if e.draft_model and e.speculative not in (None, "draft-model"):
        raise ConfigError(
            "engine.draft_model", f"drafts with speculative draft-model, not {e.speculative}"
        )
    if e.speculative == "draft-model" and not e.draft_model:
        raise ConfigError("engine.draft_model", "speculative draft-model needs one (a path)")
    _choice("logging.level", lg.level, logs.LEVELS)
    _choice("server.thinking_default", sv.thinking_default, THINKING_DEFAULTS)
    _choice("server.tool_call_parser", sv.tool_call_parser, TOOL_CALL_PARSERS)
    for scheme in sv.image_url_schemes.split(","):
        _choice("server.image_url_schemes", scheme.strip(), IMAGE_SCHEMES)
    for key in (
        "image_max_count",
        "image_max_bytes",
        "image_max_total_bytes",
        "image_max_pixels",
        "image_fetch_timeout_s",
    ):
        if getattr(sv, key) <= 0:
            raise ConfigError(f"server.{key}", "must be positive")
    _choice("logging.format", lg.format, logs.FORMATS)
    for key in ("kv_cache_memory_gb", "block_size", "max_num_seqs", "max_num_batched_tokens"):
        if getattr(e, key) <= 0:
            raise ConfigError(f"engine.{key}", "must be positive")
    for key in (
        "host_cache_memory_gb",
        "image_cache_memory_gb",
        "swa_cache_memory_gb",
        "kv_store_capacity_gb",
        "cpu_threads",
    ):
        if getattr(e, key) < 0:
            raise ConfigError(f"engine.{key}", "must not be negative")
    if e.max_model_len is not None and e.max_model_len <= 0:
        raise ConfigError("engine.max_model_len", "must be positive")
    if not 0 < e.kv_store_low_watermark <= e.kv_store_high_watermark <= 1:
        raise ConfigError("engine.kv_store_high_watermark", "watermarks need 0 < low <= high <= 1")
    if e.kv_store_io_threads < 1 or e.kv_store_gc_interval_s <= 0:
        raise ConfigError(
            "engine.kv_store_io_threads", "needs at least one thread and a positive GC interval"
        )
    if e.kv_store_read_timeout_s <= 0:
        raise ConfigError("engine.kv_store_read_timeout_s", "must be positive")
    try:
        TrafficClasses.from_specs(e.traffic_classes)
    except ValueError as err:
        raise ConfigError("engine.traffic_classes", str(err)) from None
    if e.ep_size < 1 or not 0 <= e.ep_rank < e.ep_size:
        raise ConfigError("engine.ep_rank", f"must lie in [0, ep_size={e.ep_size})")
    host, _, port = e.ep_master.rpartition(":")
    if not host or not port.isdigit():
        raise ConfigError("engine.ep_master", f"{e.ep_master!r} is not host:port")
    for key in ("ep_slots_per_rank", "moe_stats_interval", "moe_rebalance_interval"):
        if getattr(e, key) < 0:
            raise ConfigError(f"engine.{key}", "must not be negative")
    if e.moe_stats_window < 1:
        raise ConfigError("engine.moe_stats_window", "must be at least 1")
    if not 0 <= sv.port <= 65535:
        raise ConfigError("server.port", "must lie in [0, 65535]")
    for key in ("max_body_bytes", "shutdown_timeout"):
        if getattr(sv, key) <= 0:
            raise ConfigError(f"server.{key}", "must be positive")
    for key in ("max_waiting", "response_store_max_count", "response_store_memory_gb"):
        if getattr(sv, key) < 0:
            raise ConfigError(f"server.{key}", "must not be negative")
    if sv.response_store_ttl_s <= 0:
        raise ConfigError("server.response_store_ttl_s", "must be positive")
    _check_cluster(s.cluster, sv)


def _check_cluster(c: ClusterConfig, sv: ServerConfig) -> None:
    _choice("cluster.role", c.role, ROLES)
    try:
        etcd = etcd_endpoint(c.discovery)
    except ValueError as err:
        raise ConfigError("cluster.discovery", str(err)) from None
    for key, urls in (("cluster.peers", c.peers), ("cluster.routers", c.routers)):
        for url in urls:
            try:
                base_url(url)
            except ValueError as err:
                raise ConfigError(key, str(err)) from None
    if c.advertise_url is not None:
        try:
            base_url(c.advertise_url)
        except ValueError as err:
            raise ConfigError("cluster.advertise_url", str(err)) from None
    if c.node_id is not None and not NODE_ID.match(c.node_id):
        raise ConfigError(
            "cluster.node_id", f"{c.node_id!r}: letters, digits, '.', '_', '-' (at most 128)"
        )
    if c.lease_s < 1:
        raise ConfigError("cluster.lease_s", "must be at least 1 (seconds)")
    if c.handoff_timeout_s <= 0:
        raise ConfigError("cluster.handoff_timeout_s", "must be positive")
    if c.lost_node_grace_s < 0:
        raise ConfigError("cluster.lost_node_grace_s", "must not be negative")
    if c.handoff_min_tokens < 2:
        raise ConfigError("cluster.handoff_min_tokens", "must be at least 2 (tokens)")
    if not 0 <= c.handoff_store_wait_s <= 60:
        raise ConfigError("cluster.handoff_store_wait_s", "must be in [0, 60] (seconds)")
    if c.role_drain_timeout_s <= 0:
        raise ConfigError("cluster.role_drain_timeout_s", "must be positive")
    if not 1 <= c.prefill_balance_rel < float("inf"):
        raise ConfigError("cluster.prefill_balance_rel", "must be a number >= 1")
    if c.prefill_balance_abs < 0:
        raise ConfigError("cluster.prefill_balance_abs", "must be >= 0 (requests)")
    _check_autoscale(c, sv)
    for url in c.image_encoders:
        try:
            base_url(url)
        except ValueError as err:
            raise ConfigError("cluster.image_encoders", str(err)) from None
    if c.image_encoders and c.role in ("encoder", "router"):
        raise ConfigError("cluster.image_encoders", f"a {c.role} node sends no images elsewhere")
    if c.image_encode_timeout_s <= 0:
        raise ConfigError("cluster.image_encode_timeout_s", "must be positive")
    if c.role in ("prefill", "decode") and etcd is None and not c.peers:
        raise ConfigError(
            "cluster.peers",
            f"a {c.role} node registers somewhere: give the router's URL (--peers) or "
            "--discovery etcd://HOST:PORT",
        )
    registers = c.role in ("prefill", "decode") or (
        c.role in ("unified", "encoder") and (c.peers or etcd)
    )
    if registers and sv.host in _WILDCARDS and c.advertise_url is None:
        raise ConfigError(
            "cluster.advertise_url",
            f"server.host {sv.host!r} is no address peers can reach: give --advertise-url",
        )


def _check_autoscale(c: ClusterConfig, sv: ServerConfig) -> None:
    try:
        autoscale_targets(c)
    except ValueError as err:
        raise ConfigError("cluster.autoscale", str(err)) from None
    if c.autoscale_window_s <= 0:
        raise ConfigError("cluster.autoscale_window_s", "must be positive")
    if c.autoscale and c.role != "router":
        raise ConfigError("cluster.autoscale", "only a router (--role router) autoscales")
    if c.autoscale and not sv.admin_token:
        raise ConfigError(
            "server.admin_token",
            "the autoscaler changes roles through the nodes' admin calls: set the token "
            "(DEEPINFER_SERVER_ADMIN_TOKEN) here and on the nodes",
        )


def _choice(name: str, value: str, options: tuple[str, ...]) -> None:
    if value not in options:
        raise ConfigError(name, f"{value!r} is not one of {', '.join(options)}")
