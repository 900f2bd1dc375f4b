"""How the tools write numbers for people: durations, clock positions, sizes, plurals."""

from __future__ import annotations


def format_duration(seconds: float) -> str:
    """`42.1 s`, `3 min 05 s`, `2 h 04 min`, `3 d 02 h`: exact enough for a person."""
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(round(seconds)), 60)
    if minutes < 60:
        return f"{minutes} min {secs:02d} s"
    hours, minutes = divmod(minutes, 60)
    if hours < 48:
        return f"{hours} h {minutes:02d} min"
    days, hours = divmod(hours, 24)
    return f"{days} d {hours:02d} h"


def format_clock(seconds: float) -> str:
    """Elapsed time as `m:ss` or `h:mm:ss`, for positions within a run."""
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


def plural(count: int, noun: str, nouns: str | None = None) -> str:
    """`1 failure`, `2 failures` (`nouns` for an irregular plural)."""
    return f"{count} {noun if count == 1 else nouns or noun + 's'}"


def format_bytes(size: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1000 or unit == "GB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1000
    raise AssertionError("unreachable")


