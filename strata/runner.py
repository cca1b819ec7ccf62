"""Drive an engine through a list of requests to the end, with an optional progress bar."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from strata.engine.llm_engine import Engine
from strata.engine.request import Request
from strata.metrics import run_metrics


def run_requests(engine: Engine, requests: list[Request], progress: bool = False) -> dict[str, Any]:
    """Add every request (all validated first), step until done; returns the run's metrics."""
    for r in requests:
        r.stream_text = False  # text is decoded once at the end: no per-step detokenising
        engine.add_request(r)
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=sum(r.params.max_tokens for r in requests), unit="tok",
                   desc="decoding", leave=False, dynamic_ncols=True)
    try:
        while engine.has_work():
            outs = engine.step()
            if bar is not None:
                bar.update(sum(len(o.new_token_ids) for o in outs))
    finally:
        if bar is not None:
            bar.close()
    engine.trace.flush()
    return run_metrics(sorted(engine.requests.values(), key=lambda rs: rs.order), engine.stats())


def write_outputs(engine: Engine, out_dir: Path) -> list[dict[str, Any]]:
    rows = []
    for rs in sorted(engine.requests.values(), key=lambda rs: rs.order):
        rows.append({"id": rs.id, "text": engine.final_text(rs), "token_ids": rs.emitted,
                     "finish_reason": rs.reason, "prompt_tokens": rs.prompt_len,
                     "output_tokens": len(rs.emitted), **({"error": rs.error} if rs.error else {})})
    with open(out_dir / "outputs.jsonl", "w", encoding="utf-8") as f:
        for r in rows:
            f.write(json.dumps(r) + "\n")
    return rows
