"""Rating data for the simulator: loaders and the `Ratings` container, per-user splits, planted matrices."""
