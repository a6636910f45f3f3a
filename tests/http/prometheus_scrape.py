"""Scrapes ditstream's /metrics as a Prometheus server would and parses it with the Prometheus
project's own OpenMetrics parser (the `prometheus_client` package, from PyPI), which refuses text a
Prometheus server would not ingest. Run by tests/http_api.rs with the server's base URL; prints a
JSON report last: the content type, then each family's type and samples."""

import json
import sys
import urllib.request

from prometheus_client.openmetrics.parser import text_string_to_metric_families

with urllib.request.urlopen(sys.argv[1] + "/metrics") as response:
    content_type = response.headers["content-type"]
    text = response.read().decode()

families = {}
for family in text_string_to_metric_families(text):
    samples = [[s.name, s.labels, s.value] for s in family.samples]
    families[family.name] = {"type": family.type, "samples": samples}
print(json.dumps({"content_type": content_type, "families": families}))
