"""The snapshot package's exceptions, by cause."""

from __future__ import annotations


class SnapshotError(Exception):
    """A snapshot that cannot be used: unreadable, unsafe to load, damaged or of an unknown format."""


class IncompatibleSnapshotError(SnapshotError):
    """A valid snapshot written by a run with another model or data set-up."""


class SnapshotStoreError(Exception):
    """The store could not do what was asked."""


class SnapshotWriteError(SnapshotStoreError):
    """A snapshot could not be made durable; the previous snapshots are untouched."""
