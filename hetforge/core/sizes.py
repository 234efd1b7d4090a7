"""Byte sizes as users write them ("10GiB", "512MiB", "16GB", "2e9") and as hetforge prints them."""

from __future__ import annotations

import math

_UNITS = {"b": 1}
for _i, _p in enumerate("kmgtp", start=1):
    _UNITS[_p] = _UNITS[f"{_p}b"] = 1000.0**_i
    _UNITS[f"{_p}ib"] = 1024.0**_i


def parse_size(text: str | float | int) -> float:
    """'10GiB', '512MiB', '1.5e9', 2e9 -> bytes. Blank, infinite and not-a-number sizes are errors:
    none of them is a memory size."""
    if isinstance(text, bool):
        raise ValueError(f"cannot read memory size {text!r}: use e.g. 10GiB, 512MiB, 8GB or a byte count")
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        s = str(text).strip().lower().replace(" ", "")
        num = s.rstrip("abcdefghijklmnopqrstuvwxyz")
        unit = s[len(num):] or "b"
        try:
            value = float(num) * _UNITS[unit]
        except (KeyError, ValueError):
            raise ValueError(f"cannot read memory size {text!r}: use e.g. 10GiB, 512MiB, 8GB or a byte count") from None
    if not math.isfinite(value):
        raise ValueError(f"memory size {text!r} is not finite")
    return value


def format_bytes(n: float, round_up: bool = False) -> str:
    """Two decimals in the largest binary unit; `round_up` for a minimum, so that the figure
    printed, passed back, is never below what it stands for."""
    for unit, scale in (("PiB", 2**50), ("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            value = math.ceil(n / scale * 100) / 100 if round_up else n / scale
            return f"{value:.2f} {unit}"
    return f"{math.ceil(n) if round_up else n:.0f} B"
