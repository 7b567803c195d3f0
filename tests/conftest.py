import os

# Tests never reach the network: no dataset download, no model hub.
os.environ.setdefault("FEDGUIDE_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
