"""fot.models."""
