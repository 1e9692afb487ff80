"""Byte sizes written for people: ``"5GB"``, ``"512MiB"``, ``"1.5 GiB"``, ``"4096"``.

Units are case-insensitive. Decimal units count in powers of 1000, binary units in
powers of 1024, and the one-letter shorthands are *binary* because that is what
people mean by "8G" of RAM (and what ``free -h`` and Kubernetes' ``Gi`` print)::

    B                      1
    KB   MB   GB   TB      1000, 1000**2, 1000**3, 1000**4
    KiB  MiB  GiB  TiB     1024, 1024**2, 1024**3, 1024**4
    K    M    G    T       same as KiB, MiB, GiB, TiB

A number without a unit is bytes. A fractional number with a unit is rounded to the
nearest byte (``"1.1 KiB"`` is 1126); a fractional number of plain bytes is an error.
Arithmetic is exact (:class:`~fractions.Fraction`, never float), so ``"1.5 GiB"`` is
exactly 1610612736 and not a float's neighbour.
"""

from __future__ import annotations

import re
from fractions import Fraction

from lmtier.errors import ConfigError, brief

__all__ = ["parse_size", "format_size"]

_UNITS: dict[str, int] = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "k": 1024,
    "m": 1024**2,
    "g": 1024**3,
    "t": 1024**4,
}

# Largest first: format_size picks the first unit the value reaches.
_BINARY_UNITS: tuple[tuple[str, int], ...] = (
    ("TiB", 1024**4),
    ("GiB", 1024**3),
    ("MiB", 1024**2),
    ("KiB", 1024),
)

_SIZE_RE = re.compile(
    r"\s*(?P<sign>[-+]?)\s*(?P<number>\d+(?:\.\d*)?|\.\d+)\s*(?P<unit>[A-Za-z]*)\s*", re.ASCII
)


def parse_size(text: str | int) -> int:
    """Return the number of bytes that ``text`` names; raise ConfigError if it names none.

    An ``int`` is taken as bytes. Negative sizes, unknown units and empty strings are
    errors; the message quotes the bad text and lists the units.
    """
    if isinstance(text, bool) or not isinstance(text, (int, str)):
        raise ConfigError(
            f"invalid size {brief(text)}: expected an integer or a string like '8GiB'"
        )
    if isinstance(text, int):
        if text < 0:
            raise ConfigError(f"invalid size {brief(text)}: must be >= 0")
        return text
    match = _SIZE_RE.fullmatch(text)
    if match is None:
        raise ConfigError(
            f"invalid size {brief(text)}: expected a non-negative number and an optional unit "
            "(B, KB, MB, GB, TB, KiB, MiB, GiB, TiB, K, M, G, T)"
        )
    if match["sign"] == "-" and Fraction(match["number"]) != 0:
        raise ConfigError(f"invalid size {brief(text)}: must be >= 0")
    unit = match["unit"].lower()
    if unit not in _UNITS:
        raise ConfigError(
            f"invalid size {brief(text)}: unknown unit {brief(match['unit'])} "
            "(use B, KB, MB, GB, TB, KiB, MiB, GiB, TiB, K, M, G or T)"
        )
    number = Fraction(match["number"])
    if _UNITS[unit] == 1 and number.denominator != 1:
        raise ConfigError(f"invalid size {brief(text)}: not a whole number of bytes")
    return round(number * _UNITS[unit])


def format_size(num_bytes: int) -> str:
    """Return ``num_bytes`` in the largest binary unit it reaches, e.g. ``'1.5 GiB'``.

    At most two decimals, trailing zeros dropped; below 1 KiB the exact count of bytes
    (``'512 B'``). ``parse_size(format_size(n))`` is within half a hundredth of the unit
    of ``n`` (under 0.5%), and exact whenever ``n`` is a whole multiple of that unit.
    """
    if isinstance(num_bytes, bool) or not isinstance(num_bytes, int) or num_bytes < 0:
        raise ValueError(f"format_size needs a non-negative int, got {brief(num_bytes)}")
    for index, (name, size) in enumerate(_BINARY_UNITS):
        if num_bytes >= size:
            hundredths = round(Fraction(num_bytes * 100, size))
            if hundredths == 1024 * 100 and index > 0:  # 1023.999 MiB prints as 1 GiB
                return f"1 {_BINARY_UNITS[index - 1][0]}"
            whole, frac = divmod(hundredths, 100)
            text = f"{whole}.{frac:02d}".rstrip("0").rstrip(".")
            return f"{text} {name}"
    return f"{num_bytes} B"
