"""Drive an engine through a list of requests to the end, with an optional progress bar."""

from __future__ import annotations

import json
from pathlib import Path
from contextlib import contextmanager
from typing import Any, Iterator

from strata.engine.llm_engine import Engine
from strata.engine.request import Request, RequestError
from strata.metrics import run_metrics


@contextmanager
def located(rid: str, origins: dict[str, str]) -> Iterator[None]:
    """Prefix a RequestError with where the request came from and its id:
    `requests.jsonl:3: request 'a': prompt: ...`."""
    try:
        yield
    except RequestError as e:
        where = origins.get(rid)
        e.args = (f"{where + ': ' if where else ''}request {rid!r}: {e}",)
        raise


def run_requests(engine: Engine, requests: list[Request], progress: bool = False,
                 concurrency: int = 0) -> dict[str, Any]:
    """Add the requests and step until done; returns the run's metrics.

    concurrency 0: every request is added at once (each arrives at its own step or second).
    k >= 1: a closed loop, as k clients that each send their next request when the last one
    finished: the first k are added, and every finish adds the next request, arriving in the
    following iteration (its own arrival is ignored)."""
    if concurrency < 0:
        raise ValueError(f"concurrency must be >= 0, got {concurrency}")
    ids = [r.id for r in requests]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise RequestError("id", f"duplicate request id {dup!r}")
    for r in requests:
        r.stream_text = False  # text is decoded once at the end: no per-step detokenising
    first, held = (requests, []) if concurrency == 0 else (requests[:concurrency], requests[concurrency:])
    origins = getattr(requests, "origins", {})  # a Workload knows each request's file:line
    for r in held:
        r.arrival_step = r.arrival_s = None  # arrives when a client is free: set below
        with located(r.id, origins):
            engine.validate_request(r)  # a bad request fails the run before it starts
    for r in first:
        with located(r.id, origins):
            engine.add_request(r)
    held.reverse()
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=sum(r.params.max_tokens for r in requests), unit="tok",
                   desc="decoding", leave=False, dynamic_ncols=True)
    try:
        while engine.has_work():
            outs = engine.step()
            for o in outs:
                if o.finished and held:
                    engine.add_request(held.pop())  # arrives at engine.steps: the next iteration
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
