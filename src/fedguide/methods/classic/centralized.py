"""Centralized: one client holding all the training data the partition used — the ceiling."""
import numpy as np

from fedguide.methods.base import METHODS, Method


@METHODS.register("centralized")
class Centralized(Method):
    """Centralized training on the union of all clients' data (the ceiling)."""

    @staticmethod
    def federation(client_indices):
        return [np.sort(np.concatenate(client_indices))]
