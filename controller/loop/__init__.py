"""The control loop: placement, launching runs of Ray actors, progress, settlement, restaging,
and the one policy that decides what a run's end means."""
