"""The torch-free file core of snapshots: layout, checksums, strict JSON, storage backends, the manifest and the store.

Nothing here imports torch (an import-linter contract checks it): `elastic-ddp inspect` reads snapshots with it alone.
"""
