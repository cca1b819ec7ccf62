"""The scripts' name for strata.tools.provenance (the commit a benchmark ran at)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from strata.tools.provenance import commit_id  # noqa: E402,F401
