"""How a cluster is named to Ray: one custom resource per cluster pins workers to it.

The controller, the WAN testbed and the local runner all go through `cluster_resource`, so a
worker placed by any of them lands on the node(s) that advertise the same resource.
"""

from __future__ import annotations

import re

_VALID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}$")


def cluster_resource(name: str) -> str:
    """The Ray custom resource a node advertises (one unit per worker slot) for cluster `name`."""
    if not _VALID.match(name):
        raise ValueError(
            f"cluster name {name!r}: use 1-63 letters, digits, '_', '.' or '-', "
            "starting with a letter or digit"
        )
    return f"cpn-cluster-{name}"
