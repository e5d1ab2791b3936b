"""Cluster labels the planner reads: checked when written, read leniently when planning.

Labels are free-form strings, but a few are numbers the cost model uses. A bad one is refused
when an admin writes it (a 422 naming the label); a bad one already stored (written before
this check, or straight into the database) is logged once and ignored by the planner, so one
cluster's typo never fails every quote and every reconcile pass for everyone.
"""

from __future__ import annotations

import logging
import math
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from controller.values.errors import Invalid

log = logging.getLogger("cpn.labels")


@dataclass(frozen=True)
class NumericLabel:
    """A label whose value is a number in (low, high]."""

    key: str
    low: float
    high: float
    meaning: str
    example: str = "100"


NUMERIC_LABELS: dict[str, NumericLabel] = {
    spec.key: spec
    for spec in (
        NumericLabel(
            "intra_bandwidth_gbps", 0.0, 1e5, "bandwidth between GPUs inside the cluster, Gbit/s"
        ),
        NumericLabel("gpu_tflops", 0.0, 1e6, "peak TFLOPS of one GPU, for models cpn lacks"),
        NumericLabel(
            "uplink_gbps", 0.0, 1e5, "the datacenter's WAN uplink, shared by all its paths, Gbit/s"
        ),
        NumericLabel(
            "downlink_gbps",
            0.0,
            1e5,
            "the datacenter's WAN downlink, shared by all its paths, Gbit/s",
        ),
        NumericLabel(
            "wan_job_share",
            0.0,
            1.0,
            "the largest share of the uplink and downlink one job is planned on",
            "0.5",
        ),
    )
}


def _problem(spec: NumericLabel, value: Any) -> str | None:
    """Why `value` is no good for `spec`, or None when it is."""
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if isinstance(value, bool) or not math.isfinite(number):
        return f"label {spec.key} ({spec.meaning}) must be a number; got {value!r}"
    if not spec.low < number <= spec.high:
        return (
            f"label {spec.key} ({spec.meaning}) must be above {spec.low:g} and at most "
            f"{spec.high:g}; got {value!r}"
        )
    return None


def check_labels(labels: Mapping[str, Any]) -> None:
    """Raise Invalid naming the first label the planner could not use (`labels.<key>`)."""
    for key, value in labels.items():
        spec = NUMERIC_LABELS.get(key)
        if spec is None:
            continue
        problem = _problem(spec, value)
        if problem is not None:
            raise Invalid(f"{problem}; send a number such as {spec.example}", field=f"labels.{key}")


_warned: set[tuple[str, str, str]] = set()
_warned_lock = threading.Lock()


def number(labels: Mapping[str, Any], key: str, cluster: str) -> float | None:
    """The label as a number; None when absent or unusable (logged once per cluster and value)."""
    value = labels.get(key)
    if value is None:
        return None
    spec = NUMERIC_LABELS[key]
    problem = _problem(spec, value)
    if problem is None:
        return float(value)
    warn = (cluster, key, repr(value)[:200])
    with _warned_lock:
        first = warn not in _warned
        if len(_warned) >= 4096:
            _warned.clear()
        _warned.add(warn)
    if first:
        log.warning(
            "cluster %s: ignoring a stored label the planner cannot use: %s; fix it with "
            "PATCH /v1/clusters/%s",
            cluster,
            problem,
            cluster,
        )
    return None
