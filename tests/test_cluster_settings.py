"""[cluster] settings: the flags, the file and the environment; bad values name their key."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from daemon.cluster.config import (
    ClusterConfig,
    advertise_url,
    autoscale_targets,
    etcd_endpoint,
    node_id,
    prefill_balance,
)
from daemon.cluster.router import PrefillBalance
from daemon.service.cli import build_parser
from daemon.service.flags import overrides, settings_from
from daemon.service.settings import ConfigError, load_settings
from tests.daemons import ROOT


def _settings(*flags: str):
    return settings_from(build_parser().parse_args(["serve", *flags]))


def test_defaults_and_flags() -> None:
    c = _settings().cluster
    assert (c.role, c.peers, c.discovery, c.lease_s, c.handoff_timeout_s) == (
        "unified",
        [],
        "http",
        6.0,
        30.0,
    )
    c = _settings(
        "--role",
        "prefill",
        "--peers",
        "http://127.0.0.1:8000, http://10.0.0.2:8000/",
        "--advertise-url",
        "http://10.0.0.3:8101",
        "--node-id",
        "p0",
        "--lease-s",
        "3",
        "--handoff-timeout-s",
        "5",
        "--handoff-min-tokens",
        "512",
        "--routers",
        "http://10.0.0.9:8000",
    ).cluster
    assert c.handoff_min_tokens == 512 and c.routers == ["http://10.0.0.9:8000"]
    assert c.role == "prefill" and c.peers == ["http://127.0.0.1:8000", "http://10.0.0.2:8000/"]
    assert (c.advertise_url, c.node_id, c.lease_s, c.handoff_timeout_s) == (
        "http://10.0.0.3:8101",
        "p0",
        3.0,
        5.0,
    )
    assert _settings("--role", "decode", "--discovery", "etcd://127.0.0.1:2379").cluster.discovery
    assert _settings("--role", "router").cluster.role == "router"
    enc = _settings("--role", "encoder").cluster
    assert enc.role == "encoder" and enc.image_encoders == []
    node = _settings("--image-encoders", "http://127.0.0.1:8300,http://10.0.0.4:8300").cluster
    assert node.image_encoders == ["http://127.0.0.1:8300", "http://10.0.0.4:8300"]
    with pytest.raises(SystemExit):  # argparse: not a role
        build_parser().parse_args(["serve", "--role", "gateway"])


def test_file_and_environment(tmp_path: Path) -> None:
    path = tmp_path / "node.toml"
    path.write_text('[cluster]\nrole = "decode"\npeers = ["http://127.0.0.1:8000"]\nlease_s = 4\n')
    s = load_settings(path)
    assert s.cluster.role == "decode" and s.cluster.lease_s == 4.0
    env = {
        "DEEPINFER_CLUSTER_PEERS": "http://127.0.0.1:8000,http://127.0.0.1:8001",
        "DEEPINFER_CLUSTER_NODE_ID": "d7",
    }
    s = load_settings(path, env)
    assert s.cluster.peers == ["http://127.0.0.1:8000", "http://127.0.0.1:8001"]
    assert s.cluster.node_id == "d7"


@pytest.mark.parametrize(
    ("flags", "key"),
    [
        (["--role", "prefill"], "cluster.peers"),  # registers nowhere
        (["--role", "decode", "--peers", "127.0.0.1:8000"], "cluster.peers"),
        (["--discovery", "zookeeper://x:1"], "cluster.discovery"),
        (["--discovery", "etcd://127.0.0.1"], "cluster.discovery"),
        (["--node-id", "a/b"], "cluster.node_id"),
        (["--lease-s", "0.5"], "cluster.lease_s"),
        (["--handoff-timeout-s", "0"], "cluster.handoff_timeout_s"),
        (["--handoff-min-tokens", "1"], "cluster.handoff_min_tokens"),
        (["--routers", "127.0.0.1:8000"], "cluster.routers"),
        (["--advertise-url", "ftp://x"], "cluster.advertise_url"),
        (["--image-encoders", "10.0.0.4:8300"], "cluster.image_encoders"),
        (["--role", "encoder", "--image-encoders", "http://x:1"], "cluster.image_encoders"),
        (["--image-encode-timeout-s", "0"], "cluster.image_encode_timeout_s"),
        (["--image-url-schemes", "data,file"], "server.image_url_schemes"),
        (["--image-max-pixels", "0"], "server.image_max_pixels"),
        (
            ["--role", "prefill", "--peers", "http://127.0.0.1:8000", "--host", "0.0.0.0"],
            "cluster.advertise_url",
        ),
        (["--role-drain-timeout-s", "0"], "cluster.role_drain_timeout_s"),
        (["--autoscale"], "cluster.autoscale"),  # only a router
        (["--role", "router", "--autoscale"], "server.admin_token"),
        (["--autoscale-up", "0.5", "--autoscale-down", "0.6"], "cluster.autoscale"),
        (["--autoscale-window-s", "0"], "cluster.autoscale_window_s"),
        (["--prefill-balance-rel", "0.9"], "cluster.prefill_balance_rel"),
        (["--prefill-balance-abs", "-1"], "cluster.prefill_balance_abs"),
    ],
)
def test_bad_values_name_the_key(flags: list[str], key: str) -> None:
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        _settings(*flags)


def test_autoscale_settings() -> None:
    assert _settings().cluster.autoscale is False
    env = {"DEEPINFER_SERVER_ADMIN_TOKEN": "t0k", "DEEPINFER_CLUSTER_AUTOSCALE_TTFT_P99_S": "0.5"}
    flags = ["serve", "--role", "router", "--autoscale", "--autoscale-node-dwell-s", "30"]
    args = build_parser().parse_args(flags)
    s = load_settings(None, env, overrides(args))
    targets = autoscale_targets(s.cluster)
    assert s.cluster.autoscale and s.server.admin_token == "t0k"
    assert (targets.ttft_p99_s, targets.node_dwell_s, targets.up) == (0.5, 30.0, 1.0)


def test_prefill_balance_settings() -> None:
    assert prefill_balance(_settings().cluster) == PrefillBalance(1.5, 4)  # the router's default
    c = _settings("--role", "router", "--prefill-balance-rel", "2.5", "--prefill-balance-abs", "0")
    assert prefill_balance(c.cluster) == PrefillBalance(2.5, 0)
    env = {"DEEPINFER_CLUSTER_PREFILL_BALANCE_ABS": "9"}
    assert load_settings(None, env).cluster.prefill_balance_abs == 9


def test_serve_refuses_bad_cluster_flags() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "daemon", "serve", "--role", "decode"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "cluster.peers" in done.stderr
    assert "Traceback" not in done.stderr


def test_derived_addresses() -> None:
    assert etcd_endpoint("http") is None
    assert etcd_endpoint("etcd://127.0.0.1:2379") == ("127.0.0.1", 2379)
    cfg = ClusterConfig(role="decode")
    assert advertise_url(cfg, "127.0.0.1", 8101) == "http://127.0.0.1:8101"
    assert advertise_url(cfg, "::1", 8101) == "http://[::1]:8101"
    cfg = ClusterConfig(role="decode", advertise_url="http://d0.internal:80/")
    assert advertise_url(cfg, "0.0.0.0", 8101) == "http://d0.internal:80"
    assert node_id(ClusterConfig(role="prefill"), 8101).startswith("prefill-")
    assert node_id(ClusterConfig(node_id="p0"), 8101) == "p0"


@pytest.mark.parametrize("name", ["router0", "prefill0", "decode0", "encoder0"])
def test_example_settings_per_role(name: str) -> None:
    s = load_settings(ROOT / "systemd" / f"{name}.toml")
    assert s.cluster.role == name.rstrip("0")
