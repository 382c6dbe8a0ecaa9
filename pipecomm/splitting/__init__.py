"""Cutting a model into pipeline stages: an nn.Sequential chain, or any model captured by torch.export and cut at its annotations."""
