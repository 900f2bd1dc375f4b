"""Running torch's rendezvous handlers side by side in one process (one thread per "agent")."""

from __future__ import annotations

import threading


def rendezvous_together(handlers, timeout: float = 90) -> list:
    """Every handler's next_rendezvous, run at once; their RendezvousInfo (or exception), in order.
    Fails the test if one has not returned within `timeout` seconds."""
    results: list = [None] * len(handlers)

    def run(index):
        try:
            results[index] = handlers[index].next_rendezvous()
        except Exception as exc:  # noqa: BLE001 - reported to the test
            results[index] = exc

    threads = [threading.Thread(target=run, args=(index,), daemon=True) for index in range(len(handlers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=timeout)
    assert not any(thread.is_alive() for thread in threads), "a rendezvous did not return"
    return results
