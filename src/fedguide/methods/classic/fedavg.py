"""FedAvg (McMahan et al., 2017): local SGD, sample-weighted averaging. The Method defaults."""
from fedguide.methods.base import METHODS, Method


@METHODS.register("fedavg")
class FedAvg(Method):
    """FedAvg: local training, sample-weighted averaging of the weights."""

    paper = "https://arxiv.org/abs/1602.05629"
