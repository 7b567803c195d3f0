"""Methods, one module each; importing this package registers them all."""
from fedguide.methods.base import METHODS, ClientContext, Method, Record, record_bytes  # noqa: F401
from fedguide.methods import centralized, fedavg, fedprox, local  # noqa: F401
