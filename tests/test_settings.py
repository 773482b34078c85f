"""Settings: a TOML file, environment overrides, command-line overrides, in that order;
bad files are rejected with a message naming the key (`deepinfer config check` too)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from daemon.service.settings import ConfigError, load_settings
from tests.daemons import ROOT

GOOD = """
[engine]
kv_cache_memory_gb = 2
max_num_seqs = 32
traffic_classes = ["batch=12h"]
[server]
port = 9000
[logging]
level = "debug"
"""


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "node.toml"
    path.write_text(text)
    return path


def test_file_then_environment_then_flags(tmp_path: Path) -> None:
    path = _write(tmp_path, GOOD)
    s = load_settings(path)
    assert s.engine.kv_cache_memory_gb == 2.0 and s.engine.max_num_seqs == 32
    assert s.server.port == 9000 and s.logging.level == "debug"
    env = {
        "DEEPINFER_ENGINE_MAX_NUM_SEQS": "64",
        "DEEPINFER_SERVER_API_KEY": "k",
        "DEEPINFER_CACHE": "/x",
    }
    s = load_settings(path, env)
    assert s.engine.max_num_seqs == 64 and s.server.api_key == "k"
    s = load_settings(path, env, {"engine": {"max_num_seqs": 8}})
    assert s.engine.max_num_seqs == 8 and s.server.port == 9000


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("[engine]\nkv_cache_memory = 2\n", "engine.kv_cache_memory"),
        ("[engin]\nmodel = 'x'\n", "engin"),
        ("[engine]\nmax_num_seqs = 'many'\n", "engine.max_num_seqs"),
        ("[engine]\nmax_num_seqs = 0\n", "engine.max_num_seqs"),
        ("[engine]\noverlap = 1\n", "engine.overlap"),
        ("[engine]\nswa_miss_policy = 'guess'\n", "engine.swa_miss_policy"),
        ("[engine]\nspec_min_gain = -0.1\n", "engine.spec_min_gain"),
        ("[engine]\ntraffic_classes = ['Bad Name=1d']\n", "engine.traffic_classes"),
        (
            "[engine]\nkv_store_high_watermark = 0.5\nkv_store_low_watermark = 0.7\n",
            "engine.kv_store_high_watermark",
        ),
        ("[server]\nport = 70000\n", "server.port"),
        ("[server]\nthinking_default = 'maybe'\n", "server.thinking_default"),
        ("[logging]\nformat = 'xml'\n", "logging.format"),
        ("engine = 3\n", "engine"),
        ("[engine\n", "node.toml"),
    ],
)
def test_bad_files_name_the_key(tmp_path: Path, text: str, key: str) -> None:
    with pytest.raises(ConfigError) as e:
        load_settings(_write(tmp_path, text))
    assert key in str(e.value)


def test_unknown_key_suggests_the_right_one(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="did you mean 'kv_cache_memory_gb'"):
        load_settings(_write(tmp_path, "[engine]\nkv_cache_memory_g = 2\n"))


def test_bad_environment_values_name_the_variable() -> None:
    with pytest.raises(ConfigError, match="DEEPINFER_ENGINE_MAX_NUM_SEQS"):
        load_settings(None, {"DEEPINFER_ENGINE_MAX_NUM_SEQS": "lots"})
    with pytest.raises(ConfigError, match="DEEPINFER_ENGINE_MAX_NUM_SEQ"):
        load_settings(None, {"DEEPINFER_ENGINE_MAX_NUM_SEQ": "4"})


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "daemon", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_config_check_command(tmp_path: Path) -> None:
    ok = _cli("config", "check", str(_write(tmp_path, GOOD)))
    assert ok.returncode == 0 and "ok" in ok.stdout and "engine.max_num_seqs = 32" in ok.stdout
    bad = _cli("config", "check", str(_write(tmp_path, "[server]\nprot = 1\n")))
    assert (
        bad.returncode == 2 and "server.prot" in bad.stderr and "did you mean 'port'" in bad.stderr
    )


def test_serve_refuses_a_bad_file(tmp_path: Path) -> None:
    done = _cli("serve", "--config", str(_write(tmp_path, "[engine]\nblock_size = -1\n")))
    assert done.returncode == 2 and "engine.block_size" in done.stderr
    assert "Traceback" not in done.stderr


def test_overlap_by_default_only_where_the_forward_leaves_a_core_free() -> None:
    import os

    import torch

    from daemon.build.config import EngineConfig
    from daemon.build.engine import resolve_overlap
    from daemon.service.cli import build_parser
    from daemon.service.flags import overrides

    cores, cpu = len(os.sched_getaffinity(0)), torch.device("cpu")
    assert resolve_overlap(EngineConfig(), cpu, cores) is False
    if cores > 1:  # a core left to the loop
        assert resolve_overlap(EngineConfig(), cpu, cores - 1) is True
    assert resolve_overlap(EngineConfig(), torch.device("cuda"), 0) is True
    assert resolve_overlap(EngineConfig(overlap=True), cpu, cores) is True
    assert resolve_overlap(EngineConfig(overlap=False), torch.device("cuda"), 0) is False
    flags = {(): None, ("--overlap",): True, ("--no-overlap",): False}
    for args, want in flags.items():
        given = overrides(build_parser().parse_args(["serve", *args]))["engine"]
        assert given.get("overlap") is want
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--overlap", "--no-overlap"])


def test_thinking_default_from_file_environment_and_flag(tmp_path: Path) -> None:
    from daemon.service.cli import build_parser
    from daemon.service.flags import settings_from

    assert load_settings().server.thinking_default == "auto"
    path = _write(tmp_path, "[server]\nthinking_default = 'off'\n")
    assert load_settings(path).server.thinking_default == "off"
    env = {"DEEPINFER_SERVER_THINKING_DEFAULT": "on"}
    assert load_settings(path, env).server.thinking_default == "on"
    args = build_parser().parse_args(["serve", "--config", str(path), "--thinking-default", "on"])
    assert settings_from(args).server.thinking_default == "on"


def test_spec_min_gain_from_the_flag() -> None:
    from daemon.build.config import EngineConfig
    from daemon.loop.spec.policy import MIN_GAIN
    from daemon.service.cli import build_parser
    from daemon.service.flags import overrides

    assert EngineConfig().spec_min_gain == MIN_GAIN
    given = overrides(build_parser().parse_args(["serve", "--spec-min-gain", "0.25"]))
    s = load_settings(None, {}, given)
    assert s.engine.spec_min_gain == 0.25
    assert "spec_min_gain" not in overrides(build_parser().parse_args(["serve"]))["engine"]
