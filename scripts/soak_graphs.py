"""Thin main: the tool is strata.tools.soak_graphs (its docstring says what it does)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from strata.tools.soak_graphs import main  # noqa: E402

if __name__ == "__main__":
    main()
