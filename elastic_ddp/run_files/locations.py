"""Where a run keeps its files: a local path, a `file://` URL, or any other fsspec URL.

    local_path("runs/ck")            # Path("runs/ck")
    local_path("file:///data/ck")    # Path("/data/ck"): the same as the plain path
    local_path("s3://bucket/run")    # None: object storage, opened through fsspec
    url_filesystem("s3://bucket/run", "--checkpoint_dir")  # ValueError naming the flag without s3fs

The bottom layer of the package: it imports neither torch nor anything of elastic_ddp (import-linter
contracts in pyproject.toml check both), so the configuration checks a location with it before any
process group exists, and the snapshot storage backends open what it accepted.

Not checked: credentials, or whether the bucket exists. Building the filesystem object reads no
data; the first read or write finds those out.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

OBJECT_STORE_HINT = "pip install 'elastic_ddp[object-store]' and the protocol's package (s3fs, gcsfs, adlfs)"
LOCAL_URL_PREFIX = "file://"


def is_url(location: str | os.PathLike) -> bool:
    """Whether `location` names a storage by URL (`scheme://...`) rather than a local path."""
    return "://" in str(location)


def local_path(location: str | os.PathLike) -> Path | None:
    """The local directory `location` names (a path or a `file://` URL), or None for any other URL."""
    text = str(location)
    if not is_url(text):
        return Path(text)
    if text.startswith(LOCAL_URL_PREFIX):
        return Path(text[len(LOCAL_URL_PREFIX):])
    return None


def url_filesystem(url: str, flag: str) -> tuple[Any, str]:
    """The fsspec filesystem that serves `url`, and the path of `url` in it.

    Raises ValueError naming `flag`, the URL and what is accepted when the URL cannot be used here:
    fsspec is not installed, or the protocol is unknown or its driver (s3fs, gcsfs, adlfs) is missing.
    """
    try:
        import fsspec
    except ImportError as exc:
        raise ValueError(f"{flag}: got {url!r}; expected a local path, or fsspec installed for URLs "
                         f"({OBJECT_STORE_HINT})") from exc
    try:
        return fsspec.core.url_to_fs(url)
    except (ImportError, ValueError) as exc:
        raise ValueError(f"{flag}: got {url!r}; expected a local path or a URL whose fsspec driver is installed "
                         f"({exc}; {OBJECT_STORE_HINT})") from exc


def check_usable_url(url: str, flag: str) -> None:
    """Raise ValueError naming `flag` when `url`'s fsspec protocol cannot be used here (see `url_filesystem`)."""
    url_filesystem(url, flag)
