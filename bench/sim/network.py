"""The simulated compute network: clusters with GPU models, sizes and prices, and WAN links.

Shape (synthetic, seeded; representative, not a copy of any provider's data):
- regions of `per_region` clusters ("metro" sites); region i sits on continent i % 3;
- GPU models and list prices per GPU-hour from public on-demand cloud prices of 2024-25
  (H100 ~2.5-4 $, A100 ~1.3-2.5 $, L40S ~1-1.6 $, V100 ~0.9-1.4 $, L4 ~0.5-0.8 $, T4 ~0.3-0.5 $);
- cluster sizes 8-128 GPUs (most 16-32), as GPU pools of edge sites up to small datacenters;
- links: every pair inside a region (10-25 Gbit/s, 1-3 ms: metro fibre between sites), and
  each region's first site to the other regions' first sites (same continent 2-5 Gbit/s,
  20-60 ms; across continents 0.5-1.5 Gbit/s, 90-220 ms). These ranges follow published
  inter-region measurements (e.g. the per-VM inter-region throughput grids of Skyplane, Jain
  et al., NSDI 2023, and cloud providers' inter-region RTT tables); egress 0.02 $/GB inside a
  region or continent, 0.08 $/GB across (AWS-style list prices).
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import scheduler
from bench.sim.trace import REF_GPU

# model: (price range $/GPU-h, weight in the fleet)
GPU_MIX: tuple[tuple[str, tuple[float, float], float], ...] = (
    ("H100", (2.5, 4.0), 0.15),
    ("A100", (1.3, 2.5), 0.30),
    ("L40S", (1.0, 1.6), 0.10),
    ("V100", (0.9, 1.4), 0.20),
    ("L4", (0.5, 0.8), 0.15),
    ("T4", (0.3, 0.5), 0.10),
)
SIZES: tuple[tuple[int, float], ...] = ((8, 0.15), (16, 0.30), (32, 0.30), (64, 0.17), (128, 0.08))
INTRA_GBPS = {"H100": 400.0, "A100": 200.0, "L40S": 100.0, "V100": 100.0, "L4": 50.0, "T4": 25.0}


@dataclass(frozen=True)
class Network:
    """The clusters and links of one simulated network (free GPUs = all, nothing running)."""

    snapshot: scheduler.Snapshot
    regions: int

    @property
    def gpus(self) -> int:
        return sum(c.gpus_free for c in self.snapshot.clusters)

    @property
    def capacity(self) -> float:
        """GPUs in reference-GPU equivalents (datasheet peak over the reference's)."""
        ref = scheduler.peak_tflops(REF_GPU) or 1.0
        return sum(c.gpus_free * c.peak_tflops / ref for c in self.snapshot.clusters)

    def bandwidth_blind(self) -> scheduler.Snapshot:
        """The same network as a planner that ignores the WAN sees it: every link 400 Gbit/s,
        no latency and free egress (`cpn-no-bw`)."""
        from dataclasses import replace

        links = tuple(
            replace(link, bandwidth_gbps=400.0, rtt_ms=0.0, egress_price_per_gb=0.0)
            for link in self.snapshot.links
        )
        return replace(self.snapshot, links=links)


def build_network(n_clusters: int, seed: int = 0, per_region: int = 10) -> Network:
    rng = random.Random(seed)
    models = [m for m, _, _ in GPU_MIX]
    weights = [w for _, _, w in GPU_MIX]
    prices = {m: p for m, p, _ in GPU_MIX}
    clusters: list[scheduler.Cluster] = []
    for i in range(n_clusters):
        model = rng.choices(models, weights)[0]
        lo, hi = prices[model]
        size = rng.choices([s for s, _ in SIZES], [w for _, w in SIZES])[0]
        clusters.append(
            scheduler.Cluster(
                name=f"dc-{i:05d}",
                region=f"r{i // per_region:04d}",
                gpu_model=model,
                gpus_free=size,
                intra_bandwidth_gbps=INTRA_GBPS[model],
                price_per_gpu_hour=round(rng.uniform(lo, hi), 2),
            )
        )
    links: list[scheduler.Link] = []
    regions = (n_clusters + per_region - 1) // per_region
    for r in range(regions):
        members = clusters[r * per_region : (r + 1) * per_region]
        for a in range(len(members)):
            for b in range(a + 1, len(members)):
                links.append(
                    scheduler.Link(
                        members[a].name,
                        members[b].name,
                        bandwidth_gbps=round(rng.uniform(10, 25), 1),
                        rtt_ms=round(rng.uniform(1, 3), 2),
                        egress_price_per_gb=0.02,
                    )
                )
    hubs = [clusters[r * per_region] for r in range(regions)]
    for a in range(len(hubs)):
        for b in range(a + 1, len(hubs)):
            same = a % 3 == b % 3
            links.append(
                scheduler.Link(
                    hubs[a].name,
                    hubs[b].name,
                    bandwidth_gbps=round(rng.uniform(2, 5) if same else rng.uniform(0.5, 1.5), 2),
                    rtt_ms=round(rng.uniform(20, 60) if same else rng.uniform(90, 220), 1),
                    egress_price_per_gb=0.02 if same else 0.08,
                )
            )
    return Network(scheduler.Snapshot(clusters=tuple(clusters), links=tuple(links)), regions)
