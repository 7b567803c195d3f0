"""Methods, one module each, in rooms by family (classic, personalised, one_shot, frozen_encoder,
diffusion_guided); each room's ``__init__`` says what its methods share and which base to subclass.

``base`` holds the ``Method`` interface and the ``METHODS`` registry, which discovers every public module
below this package the first time a name is looked up: a new module in a room is registered without
touching any other file. Helpers used by more than one room sit here (``_personalise``, ``_synthetic``,
``_linear_probe``); a module whose name starts with ``_`` holds helpers, never a registered method.
"""
from fedguide.methods.base import METHODS, ClientContext, Method, Record, RunContext, record_bytes  # noqa: F401
