"""The runtimes, one module each (base.py: the registry, the Runtime and Executor interfaces)."""
