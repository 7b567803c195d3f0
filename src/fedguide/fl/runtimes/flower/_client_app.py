"""The ClientApp object the Flower app's pyproject.toml names (``clientapp = "...:client_app"``), which
Flower's per-message ``flwr-clientapp`` processes load.

Its own private module because building it imports Flower: the runtimes' discovery imports every public
module of fl/runtimes/, and must work where Flower is not installed.
"""
from fedguide.fl.runtimes.flower.node import flower_client_app

client_app = flower_client_app()
