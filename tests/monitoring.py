"""The metric names the Grafana dashboard and the alert rules use (import as ``from monitoring import ...``).

``metric_names_used()`` reads every PromQL expression of infra/monitoring/dashboard.json and
infra/monitoring/rules.yaml and returns the metric names each uses, as written (a histogram's
``_bucket`` / ``_count`` / ``_sum`` series by that name: what a scrape holds). ``METRICS`` is the
contract those names must come from: what the service exports through Ray (``SERVICE_METRICS``) and
what the jobs push (``JOB_METRICS``); docs/monitoring.md has a table of them. A live-scrape test can
check that each name used appears in a real scrape.

The PromQL reader is a tokenizer, enough for what the two files hold: an identifier is a metric name
unless it is followed by ``(`` (a function or an aggregation), is a keyword (``by``, ``and``, ...), or
sits inside a label matcher ``{...}``, a range ``[...]``, a label list after ``by`` / ``without`` /
``on`` / ``ignoring`` / ``group_left`` / ``group_right``, or a string.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

MONITORING = Path(__file__).resolve().parent.parent / "infra" / "monitoring"
DASHBOARD = MONITORING / "dashboard.json"
RULES = MONITORING / "rules.yaml"

_HISTOGRAM = ("_bucket", "_count", "_sum")
# the search service, through Ray's metrics API (Ray prefixes ray_; Serve adds deployment, replica and
# application)
SERVICE_METRICS = frozenset(
    ["ray_puma_requests_total", "ray_puma_request_time_seconds_total", "ray_puma_refused_total",
     "ray_puma_version_live", "ray_puma_version_switches_total", "ray_puma_index_items",
     "ray_puma_index_shards", "ray_puma_index_removed_rows", "ray_puma_index_refreshed_timestamp_seconds",
     "ray_puma_manifest_written_timestamp_seconds", "ray_puma_filter_columns_total"]
    + [f"{histogram}{part}" for histogram in ("ray_puma_request_seconds", "ray_puma_stage_seconds",
                                              "ray_puma_model_batch_size") for part in _HISTOGRAM])
# the jobs, pushed to a Pushgateway (job puma_embed, puma_train, puma_sweep), and the Pushgateway's own
JOB_METRICS = frozenset(
    ["puma_embed_items", "puma_embed_rejected_items", "puma_embed_images_per_second",
     "puma_embed_run_seconds", "puma_embed_index_items", "puma_embed_last_run_timestamp_seconds",
     "puma_embed_last_run_failed", "puma_embed_last_success_timestamp_seconds",
     "puma_train_epoch", "puma_train_loss", "puma_train_images_per_second", "puma_train_step_seconds",
     "puma_train_validation", "puma_train_last_report_timestamp_seconds",
     "puma_sweep_trials", "push_time_seconds", "push_failure_time_seconds"])
METRICS = SERVICE_METRICS | JOB_METRICS

KEYWORDS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool",
                      "and", "or", "unless", "atan2", "inf", "nan"})
LABEL_LISTS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
_TOKEN = re.compile(r"""
    (?P<string>"(?:\\.|[^"\\])*"|'(?:\\.|[^'\\])*'|`[^`]*`)
  | (?P<number>\.?\d[\w.]*)
  | (?P<name>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<variable>\$\{?\w+\}?)
  | (?P<other>\S)
""", re.VERBOSE)
_CLOSE = {"{": "}", "[": "]"}


def metric_names(expr: str) -> set[str]:
    """The metric names one PromQL expression selects, as written."""
    tokens = list(_tokens(expr))
    names, i = set(), 0
    while i < len(tokens):
        text, following = tokens[i], tokens[i + 1] if i + 1 < len(tokens) else ""
        word = text.lower()
        if word in LABEL_LISTS and following == "(":
            i = tokens.index(")", i + 1)  # the label list: by (le, route)
        elif word == "offset":
            i += 1  # the duration: offset 1d
        elif _is_name(text) and word not in KEYWORDS and following != "(" \
                and following.lower() not in ("by", "without"):  # not a function nor an aggregation
            names.add(text)
        i += 1
    return names


def _is_name(text: str) -> bool:
    return bool(re.fullmatch(r"[A-Za-z_:][A-Za-z0-9_:]*", text))


def _tokens(expr: str):
    """The tokens outside strings, label matchers {...} and ranges [...] (numbers and durations kept)."""
    closer = ""
    for match in _TOKEN.finditer(expr):
        kind, text = match.lastgroup, match.group()
        if closer:  # inside {...} or [...] (neither nests): wait for its end; strings are skipped whole
            closer = "" if text == closer else closer
        elif text in _CLOSE:
            closer = _CLOSE[text]
        elif kind not in ("string", "variable"):
            yield text


def dashboard_expressions(path: Path = DASHBOARD) -> list[str]:
    """Every target expression of every panel (panels inside collapsed rows too)."""
    panels = json.loads(path.read_text())["panels"]
    panels = panels + [inner for panel in panels for inner in panel.get("panels", [])]
    return [target["expr"] for panel in panels for target in panel.get("targets", [])]


def rule_expressions(path: Path = RULES) -> list[str]:
    """Every rule's expression in the PrometheusRule's groups."""
    spec = yaml.safe_load(path.read_text())["spec"]
    return [str(rule["expr"]) for group in spec["groups"] for rule in group["rules"]]


def metric_names_used() -> dict[str, set[str]]:
    """{"dashboard": names the dashboard uses, "rules": names the alert rules use}."""
    return {"dashboard": set().union(*map(metric_names, dashboard_expressions())),
            "rules": set().union(*map(metric_names, rule_expressions()))}
