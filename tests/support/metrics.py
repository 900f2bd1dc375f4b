"""Reading a live metrics endpoint (elastic_ddp/runlog/metrics_server.py) in tests."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def scrape(url: str) -> dict[str, float]:
    """The samples at `url` by name (`name{label="value"}` for a labelled one); raises if it does not answer."""
    with urllib.request.urlopen(url, timeout=5) as response:
        assert response.status == 200 and response.headers["Content-Type"].startswith("text/plain")
        text = response.read().decode()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f'{key}="{value}"' for key, value in sorted(sample.labels.items()))
            samples[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return samples
