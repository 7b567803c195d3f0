"""Datasets, partitions and the federated view of them."""
