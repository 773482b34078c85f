"""`deepinfer config check FILE`: a settings file (with the environment's overrides) checked and
shown key by key, without starting anything."""

from __future__ import annotations

import os
import sys

from daemon.service.settings import EXIT_INVALID_SETTINGS, SECTIONS, ConfigError, load_settings


def config_check(path: str) -> int:
    try:
        settings = load_settings(path, os.environ)
    except ConfigError as e:
        print(f"{path}: invalid: {e}", file=sys.stderr)
        return EXIT_INVALID_SETTINGS
    print(f"{path}: ok")
    for section in SECTIONS:
        for key, value in vars(getattr(settings, section)).items():
            shown = "(set)" if key == "api_key" and value else value
            print(f"  {section}.{key} = {shown!r}")
    return 0
