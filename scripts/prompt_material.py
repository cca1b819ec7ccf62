"""The benchmarks' prompt material, shipped with the repository (scripts/data/code_prompts.json:
standard-library source excerpts), so that every machine and Python version cuts the same
prompts. scripts/bench_engine.py and scripts/bench.py cut their prompts from it."""

import json
from pathlib import Path

CODE_PROMPTS = Path(__file__).resolve().parent / "data" / "code_prompts.json"


def prompt_texts() -> list[str]:
    """The excerpts, in order."""
    return [p["text"] for p in json.loads(CODE_PROMPTS.read_text(encoding="utf-8"))["prompts"]]
