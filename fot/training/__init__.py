"""fot.training."""
