"""gradsync: synchronization for data-parallel PyTorch training."""
