import json
import os
from pathlib import Path

# Tests never reach the network: no dataset download, no model hub.
os.environ.setdefault("FEDGUIDE_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# CUDA reads the cuBLAS workspace once per process: a deterministic GPU test after any other CUDA work needs it
# set from the start (fedguide sets it on import too).
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
# Under pytest-xdist (`make test` runs one worker per core) each worker computes on one thread: torch's
# default of a thread per core in every worker oversubscribes the cores and made the suite no faster.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ["MKL_NUM_THREADS"] = "1"

# Property tests draw the same examples on every run: a CI result never depends on luck. Hypothesis is a dev
# tool: where it is absent (a GPU host running tests/gpu with plain pytest) the modules that use it fail on
# their own import, the others still run.
try:
    from hypothesis import settings
except ImportError:
    settings = None
if settings is not None:
    settings.register_profile("fedguide", derandomize=True, deadline=None)
    settings.load_profile("fedguide")


# ---- tiny random Stable-Diffusion-layout pipelines, built once per session (guidance and method tests) ----
import pytest  # noqa: E402

from fedguide.guidance.tiny import build_tiny_clip, build_tiny_pipeline  # noqa: E402


@pytest.fixture(scope="session")
def tiny_sd(tmp_path_factory):
    return build_tiny_pipeline(tmp_path_factory.mktemp("tiny-sd"), seed=0)


@pytest.fixture(scope="session")
def tiny_unclip(tmp_path_factory):
    return build_tiny_pipeline(tmp_path_factory.mktemp("tiny-unclip"), seed=1, unclip=True)


@pytest.fixture(scope="session")
def tiny_clip(tmp_path_factory):
    return build_tiny_clip(tmp_path_factory.mktemp("tiny-clip"), seed=2)


# ---- GPU tests (@pytest.mark.gpu) run only where CUDA is: `make test` on a CPU skips them ----
import torch  # noqa: E402


def pytest_collection_modifyitems(config, items):
    slowest_files_first(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device (run pytest -m gpu, or scripts/device-check.sh, on a GPU host)")
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(skip)


# ---- the slowest files start first: on two workers a minute-long test that starts last sets the wall time ----
DURATIONS = Path(__file__).with_name("durations.json")


def slowest_files_first(items):
    """Orders test files by their slowest test as recorded in durations.json (seconds; files not listed count 0),
    keeping each file's tests together and in their order (module fixtures are set up once). The order is the
    same in every pytest-xdist worker, as xdist requires. Refresh the file with ``python -m tests.durations``
    after a run with ``--junitxml``."""
    slowest = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    first_seen: dict[str, int] = {}
    for i, item in enumerate(items):
        first_seen.setdefault(item.nodeid.split("::")[0], i)
    items.sort(key=lambda item: (-slowest.get(item.nodeid.split("::")[0], 0.0),
                                 first_seen[item.nodeid.split("::")[0]]))
