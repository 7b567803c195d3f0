"""Frozen-encoder methods: a pretrained image encoder (CLIP or the embedded one) stays frozen; the clients
federate centroids or a small head on its features, or nothing at all.

FedDISC and centroid fine-tuning (subclass ``CentroidOneShot`` in ``_centroids``), FedAvg-SM, SemiFL and
RSCFed (heads on frozen features: subclass ``HeadFederation`` in ``_head_federation``), and zero-shot
classification. The cached features are ``_frozen_encoder.FrozenFeatures``; these methods compute on the
host (``on_device = False``) because their models are small heads over cached features.
"""
