"""One-shot methods: the clients train once, upload, and the server builds the global model in one heavy
aggregation (from generated data or a public pool).

FedCADO, SD_Gen and FedDF. They subclass ``OneShotMethod`` (``one_shot/_one_shot.py``: the clients'
architectures, one round, the server's training of the global model); the server-side distillation loop is
``_distill``, and the synthetic-set writer and reader shared with other families is
``fedguide.methods._synthetic``.
"""
