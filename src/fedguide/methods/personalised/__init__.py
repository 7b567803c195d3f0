"""Personalised FL methods: each client keeps part (or all) of a model of its own between rounds.

FedRep, FedPer, FedBABU, Per-FedAvg, pFedMe, Ditto, FedALA, FedBN, FedProto, FedNH and FedEMA. What a client
keeps lives in the disk-backed client store (``self.run.store``), and ``personal_model`` returns it for
``eval.mode`` personal/both. Methods that federate the body and keep the head subclass ``SplitFederation``
(``personalised/_split_federation.py``); the fine-tuning shared with the default personalisation is
``fedguide.methods._personalise``; FedEMA's augmented views are in ``_ssl_views``; ``_protocol`` holds the
``protocol: feddw`` preset option (FedDW's released protocol for its pFL rows) five of them take.
"""
