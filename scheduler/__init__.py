"""The cache-aware placement policy (QUART §6.2, HydraServe §4.2), pure, and its baselines."""
