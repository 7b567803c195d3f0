"""Heads federated over frozen features: the clients train a small classifier on the frozen encoder's
features and the server averages it, round after round.

FedAvg-SM, SemiFL and RSCFed (the semi-supervised rows of FedDISC's tables; SemiFL's and RSCFed's weak and
strong views in ``_augment``). A new method of this kind subclasses ``HeadFederation`` in
``_head_federation``.
"""
