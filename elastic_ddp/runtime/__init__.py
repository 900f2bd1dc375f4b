"""The worker runtime: the process group and its context, drain on SIGTERM, the peer watchdog, /proc."""
