"""A method's own passes over client data go through ``ctx.batch`` (the run's device data), never the client's
host tensors: read on a GPU, ``data.x[idx]`` feeds host images to a device model (CUDA refuses) or copies them
every pass. The simulated device catches it when it runs; this keeps it from being written."""
from __future__ import annotations

import re
from pathlib import Path

import fedguide.methods

METHODS_DIR = Path(fedguide.methods.__file__).parent
HOST_DATA = re.compile(r"\b(?:data|ctx\.data|client)\.(?:x|y)\s*\[")
# Where the host fallback lives: ClientContext.batch and _personalise.batch_at without device data.
FALLBACKS = {"context.py": 1, "_personalise.py": 1}


def test_methods_read_client_data_through_ctx_batch():
    found = {}
    for path in sorted(METHODS_DIR.rglob("*.py")):
        hits = [n for n, line in enumerate(path.read_text().splitlines(), 1)
                if HOST_DATA.search(line) and not line.lstrip().startswith("#")]
        if len(hits) > FALLBACKS.get(path.name, 0):
            found[str(path.relative_to(METHODS_DIR))] = hits
    assert not found, f"host tensors indexed in a method (use ctx.batch(indices)): {found}"


def test_the_pattern_sees_what_it_must():
    assert HOST_DATA.search("probs.append(model(data.x[idx]))")
    assert HOST_DATA.search("x = ctx.data.y [b]")
    assert not HOST_DATA.search("x, y = ctx.batch(idx)")
