"""torch.distributed process groups (DP attention, EP experts) and launch helpers."""
