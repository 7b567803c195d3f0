"""Classic FL methods: one shared model trained by every client on its labels, aggregated on the server.

FedAvg, FedProx, FedDyn, SCAFFOLD, MOON, FedDW, FedDisco, FedCDA, FedUV, FedDistill+, Local and Centralized. They
share the default local loop (``Method.fit`` → ``local_loss``) and differ in the local objective, what
travels beside the weights, or the server's aggregation. Subclass ``fedguide.methods.base.Method`` and
override only the hooks that differ from FedAvg (``classic/fedprox.py`` is the shortest example); a
term any method can add goes in a ``Regularizer`` (``fedguide.methods.compose``, FedDW's ``dw``).
"""
