"""A method's own passes over client data go through ``ctx.batch`` (the run's device data), never the client's
host tensors: read on a GPU, ``data.x[idx]`` feeds host images to a device model (CUDA refuses) or copies them
every pass. The simulated device catches it when it runs; this keeps it from being written."""
from __future__ import annotations

import re

from tests.methods.source_scan import METHODS_DIR, matching_lines

HOST_DATA = re.compile(r"\b(?:data|ctx\.data|client)\.(?:x|y)\s*\[")
# Where the host fallback lives: ClientContext.batch and _personalise.batch_at without device data.
FALLBACKS = {"context.py": 1, "_personalise.py": 1}


def test_methods_read_client_data_through_ctx_batch():
    found = {str(path.relative_to(METHODS_DIR)): hits for path, hits in matching_lines(HOST_DATA).items()
             if len(hits) > FALLBACKS.get(path.name, 0)}
    assert not found, f"host tensors indexed in a method (use ctx.batch(indices)): {found}"


def test_the_pattern_sees_what_it_must():
    assert HOST_DATA.search("probs.append(model(data.x[idx]))")
    assert HOST_DATA.search("x = ctx.data.y [b]")
    assert not HOST_DATA.search("x, y = ctx.batch(idx)")
