"""`python -m elastic_ddp.chaos` explains itself and refuses a bad plan with its reason; its
standalone store listens where it says."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from elastic_ddp.testbed.local_cluster import free_port, port_is_listening, wait_for


def test_the_chaos_cli_explains_itself_and_refuses_bad_input(tmp_path):
    help_text = subprocess.run([sys.executable, "-m", "elastic_ddp.chaos", "--help"], capture_output=True,
                               text=True, check=True).stdout
    assert "--random" in help_text and "--plan" in help_text and "--compare" in help_text
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"faults": [{"action": "explode"}]}))
    result = subprocess.run([sys.executable, "-m", "elastic_ddp.chaos", "--plan", str(bad), "--run-dir",
                             str(tmp_path / "run"), "--", "--model", "mlp"], capture_output=True, text=True)
    assert result.returncode == 2 and "fault action: got 'explode'" in result.stderr


def listening_addresses(port: int) -> set[str]:
    """The local addresses with a socket listening on `port` (from /proc/net/tcp and tcp6)."""
    found = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as handle:
            for line in list(handle)[1:]:
                local, _, state = line.split()[1:4]
                address, port_hex = local.rsplit(":", 1)
                if state == "0A" and int(port_hex, 16) == port:  # 0A: LISTEN
                    found.add(address)
    return found


@pytest.mark.timeout(60)
def test_the_standalone_store_listens_on_the_address_it_names_only():
    port = free_port()
    store = subprocess.Popen([sys.executable, "-m", "elastic_ddp.chaos.store", f"127.0.0.1:{port}"],
                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        wait_for(lambda: port_is_listening("127.0.0.1", port) or store.poll() is not None, 30, "the store")
        assert listening_addresses(port) == {"0100007F"}  # 127.0.0.1, and not 0.0.0.0 or ::
    finally:
        store.send_signal(signal.SIGTERM)
        output = store.communicate(timeout=30)[0]
    assert f"c10d store listening on 127.0.0.1:{port} (that address only)" in output
