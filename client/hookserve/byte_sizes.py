"""Byte sizes as people write them, for every size flag of the server and of
`hookserve batch`: "512MiB", "2G", "1048576" (the units are powers of 1024)."""

from __future__ import annotations

import argparse

MiB = 1 << 20
#: Size suffixes (powers of 1024; a plain number is bytes).
SIZE_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": MiB,
              "mb": MiB, "mib": MiB, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}


def parse_bytes(value: str | int) -> int:
    """Whole bytes; ValueError saying how to write a size."""
    text = str(value).strip().lower()
    number = text.rstrip("kmgib")
    unit = text[len(number):]
    try:
        if (size := float(number) * SIZE_UNITS[unit]) != int(size):   # (half a byte)
            raise ValueError(number)   # (an unknown unit: KeyError)
        return int(size)
    except (ValueError, OverflowError, KeyError):
        raise ValueError(f"{str(value)!r} is not a size: use whole bytes, or a number with "
                         "K, M or G (KiB, MiB, GiB: 512MiB, 2G)") from None


def bytes_arg(value: str) -> int:
    """`parse_bytes` as an argparse type."""
    try:
        return parse_bytes(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
