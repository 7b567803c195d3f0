"""The ServerApp object the Flower app's pyproject.toml names (``serverapp = "...:server_app"``).

Its own private module because building it imports Flower: the runtimes' discovery imports every public
module of fl/runtimes/, and must work where Flower is not installed.
"""
from fedguide.fl.runtimes.flower.server import flower_server_app

server_app = flower_server_app()
