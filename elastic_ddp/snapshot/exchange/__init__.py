"""Moving snapshot bytes between ranks: the transport, the restore agreement, replication, RNG gathering."""
