"""The runtimes, where the clients of a run train: local.py (``local``, ``pool``) and the Flower ones in
flower/. Each registers in ``fl.runtime.RUNTIMES``, which imports every public module below this package
at the first lookup (the interface a runtime implements is in fl/runtime.py)."""
