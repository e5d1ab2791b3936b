"""The tenant's wire: what a tenant sends cpn and what cpn answers about jobs, as typed values.

For tenants what `agents.protocol` is for agents: the REST API, the CLI, the Python client
(`api.client`) and the control plane all use these models, and importing them imports no
control plane (no database, no web framework, no Ray, no torch).
"""

from wire.jobs import JobEventOut, JobLogOut, JobMetricOut, JobOut, QuoteOut
from wire.plan import HeldPlan, JobPlan
from wire.spec import JobSpec

__all__ = [
    "HeldPlan",
    "JobEventOut",
    "JobLogOut",
    "JobMetricOut",
    "JobOut",
    "JobPlan",
    "JobSpec",
    "QuoteOut",
]
