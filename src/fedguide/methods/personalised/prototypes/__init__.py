"""Prototype-based personalisation: clients share class prototypes (per-class feature means) instead of, or
beside, a classifier.

FedProto (``fedproto.py``: the prototype aggregation and class feature means) and FedNH, which builds on
FedProto's aggregation with prototypes spread uniformly on the sphere at the start and smoothed each round.
"""
