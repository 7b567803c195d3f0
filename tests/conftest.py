import os
import sys
from pathlib import Path

# Tests never reach the network: no dataset download, no model hub.
os.environ.setdefault("FEDGUIDE_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Shared helpers (tiny.py) are importable from every test folder.
sys.path.insert(0, str(Path(__file__).parent))
