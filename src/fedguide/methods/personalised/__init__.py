"""Personalised FL methods: each client keeps part (or all) of a model of its own between rounds.

What a client keeps lives in the disk-backed client store (``self.run.store``), and ``personal_model``
returns it for ``eval.mode`` personal/both. The room holds two sub-rooms and the methods of their own kind:

- ``split_model/``: the body federated, the head personal (FedRep, FedPer, FedBABU); subclass
  ``SplitFederation`` there for a new method that keeps part of the network on the clients.
- ``prototypes/``: class prototypes shared instead of, or beside, a classifier (FedProto, FedNH).
- here: a personal model beside the global one (Ditto, pFedMe), a meta-learned start (Per-FedAvg), a
  learned mix of local and global weights (FedALA), local BatchNorm layers (FedBN) and self-supervised
  representations (FedEMA, its augmented views in ``_ssl_views``).

The fine-tuning shared with the default personalisation is ``fedguide.methods._personalise``; ``_protocol``
holds the ``protocol: feddw`` preset option (FedDW's released protocol for its pFL rows) five of them take.
"""
