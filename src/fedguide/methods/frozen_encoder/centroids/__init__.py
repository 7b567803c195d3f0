"""One-shot methods on class centroids of frozen features: the clients upload per-class feature means once.

FedDISC (``feddisc.py``: the server generates images from the centroids and trains a head on them; its
released schedule in ``_released_schedule``, the Eq. 5 noising of the uploaded features in ``_feature_noise``,
the resumable generation in ``_generation_cache``) and centroid fine-tuning. A new method that federates
centroids subclasses ``CentroidOneShot`` in ``_centroids``.
"""
