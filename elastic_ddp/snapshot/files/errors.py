"""The snapshot package's exceptions, by cause."""

from __future__ import annotations


class SnapshotError(Exception):
    """A snapshot that cannot be used: unreadable, unsafe to load, damaged or of an unknown format."""


class IncompatibleSnapshotError(SnapshotError):
    """A valid snapshot written by a run with another model or data set-up."""


class NonFiniteStateError(SnapshotError):
    """A state that holds a NaN or an infinity (a diverged run): never kept, restored or made durable."""

    def __init__(self, message: str, tensors: list[str]):
        super().__init__(message)
        self.tensors = tensors  # where, as dotted paths (model.net.1.weight), the first ones only

    @property
    def reason(self) -> str:
        """The short form, for events: `non-finite: model.net.1.weight, ...`."""
        return f"non-finite: {', '.join(self.tensors)}"


class SnapshotStoreError(Exception):
    """The store could not do what was asked."""


class SnapshotWriteError(SnapshotStoreError):
    """A snapshot could not be made durable; the previous snapshots are untouched."""


class WriteCancelled(SnapshotStoreError):
    """A write stopped on its caller's request (a newer state superseded it); nothing was listed."""
