"""The Flower runtimes: fedguide's clients as Flower SuperNodes.

- ``flower-sim`` (simulation.py): every client a virtual SuperNode of Flower's simulation engine on this
  machine; its executor, simulated_clients.py.
- ``flower`` (deployment.py): a deployment on several machines; server.py is the server side
  (``fedguide serve``: the SuperLink and the ServerApp), node.py the client side (``fedguide client``),
  deployed_clients.py the executor that reaches the SuperNodes through the deployment's Grid.

What both share: records.py (fedguide's records as Flower's), messages.py (train messages and their
failures), protocol.py (what server and clients must agree on), processes.py (the processes Flower
runs, stopped by their ids); and security.py, the deployment's TLS and SuperNode keys.

Flower (and Ray) is an optional extra, imported only when a Flower runtime starts or a command that
needs it runs: every module here imports it inside the functions that use it, so discovering the
runtimes (``fedguide list``, a local run) works without it.
"""
