"""Snapshots of sharded runs (`--sharding fsdp`): DCP shards per rank, committed per step."""
