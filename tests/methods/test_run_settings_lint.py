"""Methods read the run's settings from ``RunContext``'s own fields (``run.seed``, ``run.train``, ``run.guidance``,
...), never from the whole config: what a method depends on is then named in one place, and a run context built
without a Config (a test's, a client's) serves every method."""
from __future__ import annotations

import re

from tests.methods.source_scan import METHODS_DIR, matching_lines

WHOLE_CONFIG = re.compile(r"\brun\.config\b|\bctx\.config\b")


def test_no_method_module_reads_the_whole_config():
    found = {str(path.relative_to(METHODS_DIR)): hits for path, hits in matching_lines(WHOLE_CONFIG).items()}
    assert not found, f"a method reads run.config (use the RunContext field): {found}"


def test_the_pattern_sees_what_it_must():
    assert WHOLE_CONFIG.search("seed = self.run.config.seed")
    assert WHOLE_CONFIG.search("cfg = run.config")
    assert not WHOLE_CONFIG.search("t = self.run.train")
    assert not WHOLE_CONFIG.search("model_config = ConfigDict(extra='forbid')")
