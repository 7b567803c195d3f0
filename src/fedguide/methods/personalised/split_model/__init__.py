"""Split-model personalisation: the body is federated, the head stays with each client (or is frozen).

FedRep and FedPer subclass ``SplitFederation`` (``_split_federation.py``): the server averages the body
only, each client keeps its head in the client store and fine-tunes it on its own data. FedBABU federates
the body with the head frozen at its random start and fine-tunes the head only to personalise. A new method
that keeps part of the network on the clients subclasses ``SplitFederation`` and says which part is personal.
"""
