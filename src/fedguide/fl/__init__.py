"""The engine: the runtime interface (runtime.py), opening a run (setup.py), the round loop (engine.py),
one client's round (client_step.py), checkpoints, the run-folder lock, and the runtimes that train the
clients (runtimes/: local.py, and the Flower ones in runtimes/flower/)."""
