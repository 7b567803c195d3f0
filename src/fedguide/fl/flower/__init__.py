"""Flower's side of the Flower runtimes: fedguide's clients as Flower SuperNodes, simulated
(``runtime.name: flower-sim``, sim.py) or deployed on several machines (``runtime.name: flower``:
deploy.py is the server side, ``fedguide serve``; node.py the client side, ``fedguide client``). The
runtimes themselves are registered in ``fl/runtimes/``.

Flower is imported only when a Flower runtime starts, so the local runtime never needs it.
"""
