import os
import sys
from pathlib import Path

# Tests never reach the network: no dataset download, no model hub.
os.environ.setdefault("FEDGUIDE_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Shared helpers (tiny.py) are importable from every test folder.
sys.path.insert(0, str(Path(__file__).parent))

# Property tests draw the same examples on every run: a CI result never depends on luck.
from hypothesis import settings  # noqa: E402

settings.register_profile("fedguide", derandomize=True, deadline=None)
settings.load_profile("fedguide")
