"""Data: token documents on disk, the offline sample corpus, streams for training."""
