"""Frozen-encoder methods: a pretrained image encoder (CLIP or the embedded one) stays frozen; the clients
federate centroids or a small head on its features, or nothing at all.

- ``centroids/``: FedDISC and centroid fine-tuning, one-shot on per-class centroids (subclass
  ``CentroidOneShot``).
- ``heads/``: FedAvg-SM, SemiFL and RSCFed, heads on frozen features (subclass ``HeadFederation``).
- here: zero-shot classification, and ``_frozen_encoder.FrozenFeatures``, the cached features every method
  of the room reads.

These methods compute on the host (``on_device = False``) because their models are small heads over cached
features.
"""
