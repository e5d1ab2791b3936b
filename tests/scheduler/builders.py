"""Small builders for scheduler tests: every number a test relies on is visible at the call."""

from __future__ import annotations

from scheduler import Cluster, JobRequest, Link, QoS


def cluster(name: str, gpus: int = 8, **kw: object) -> Cluster:
    args: dict[str, object] = {
        "region": "us",
        "gpu_model": "H100",
        "gpus_free": gpus,
        "intra_bandwidth_gbps": 100.0,
        "price_per_gpu_hour": 2.0,
        "efficiency": 0.5,
    }
    args.update(kw)
    return Cluster(name=name, **args)  # type: ignore[arg-type]


def link(a: str, b: str, gbps: float = 10.0, rtt_ms: float = 20.0, egress: float = 0.0) -> Link:
    return Link(a, b, gbps, rtt_ms, egress)


def job(gpus: int = 8, **kw: object) -> JobRequest:
    qos = kw.pop("qos", QoS())
    args: dict[str, object] = {
        "params": 100_000_000,
        "steps": 100,
        "min_gpus": gpus,
        "max_gpus": gpus,
        "flops_per_step": 1e15,
        "qos": qos,
    }
    args.update(kw)
    return JobRequest(**args)  # type: ignore[arg-type]
