"""Traffic classes: how long the block store keeps a class's blocks after their last use."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

DAY = 86400.0
DEFAULT_RETENTION_S = {"chat": 7 * DAY, "agent": 3 * DAY}  # the seed's figures
DEFAULT_CLASS = "chat"
_NAME = re.compile(r"^[a-z0-9][a-z0-9_-]{0,15}$")
_UNITS = {"s": 1.0, "m": 60.0, "h": 3600.0, "d": DAY}


def parse_duration(text: str) -> float:
    """'90s', '30m', '12h', '7d' or a plain number of seconds."""
    text = text.strip().lower()
    unit = _UNITS.get(text[-1:]) if text else None
    number = text[:-1] if unit else text
    try:
        value = float(number) * (unit or 1.0)
    except ValueError:
        raise ValueError(f"{text!r} is not a duration (use e.g. 90s, 30m, 12h, 7d)") from None
    if value < 0:
        raise ValueError(f"a duration cannot be negative: {text!r}")
    return value


@dataclass
class TrafficClasses:
    retention_s: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_RETENTION_S))
    default: str = DEFAULT_CLASS

    @classmethod
    def from_specs(cls, specs: list[str]) -> TrafficClasses:
        """Defaults plus `NAME=DURATION` overrides or additions (duration 0: never stored)."""
        classes = cls()
        for spec in specs:
            name, sep, duration = spec.partition("=")
            name = name.strip()
            if not sep or not _NAME.match(name):
                raise ValueError(
                    f"traffic class {spec!r}: use NAME=DURATION with NAME of 1-16 characters "
                    "a-z, 0-9, '_' or '-'"
                )
            classes.retention_s[name] = parse_duration(duration)
        return classes

    def __contains__(self, name: str) -> bool:
        return name in self.retention_s

    def names(self) -> list[str]:
        return sorted(self.retention_s)

    def retention(self, name: str) -> float:
        """Seconds after last use; unknown names (from another daemon's config) get the default's."""
        return self.retention_s.get(name, self.retention_s[self.default])
