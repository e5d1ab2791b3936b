"""The resource layer's state: clusters, GPU inventory, links, agent leases, cluster labels,
GPU reservations, and the snapshot of all of it that the scheduler plans over."""
