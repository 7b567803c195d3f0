"""Flower runtime: fedguide's clients as Flower SuperNodes (``runtime.name: flower-sim``).

Flower is imported only when a Flower runtime starts, so the local runtime never needs it.
"""
from fedguide.fl.flower.sim import FlowerClientFailed, FlowerClients, FlowerRuntimeFailed

__all__ = ["FlowerClientFailed", "FlowerClients", "FlowerRuntimeFailed"]
