"""Run the real engine in this process, for the tools that measure it (calibration, checks).

The model is loaded (and on CUDA compiled) once; every run is its own Engine on that model, so
a grid of runs pays the start-up once. Each run writes the engine's trace.jsonl and
metrics.json into its directory, the files sim.profile fits and `compare_with` reads.
This is the one sim/ module that imports strata's engine: the simulator itself never does.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

REPO = Path(__file__).resolve().parent.parent


def commit_id() -> str:
    """The commit the engine runs at (STRATA_COMMIT wins: a copy of the tree on another
    machine may carry a stale .git)."""
    env = os.environ.get("STRATA_COMMIT")
    if env:
        return env
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=REPO, capture_output=True, text=True).stdout.strip()
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


@dataclass
class RunSpec:
    """One engine run: `requests` prompts of `prompt` tokens with `out` output tokens each,
    `concurrency` of them in flight (a closed loop; 0 = all at once), on an engine with the
    `engine` overrides (names of strata's `engine` group)."""
    name: str
    requests: int
    prompt: int
    out: int
    concurrency: int = 0
    engine: dict[str, Any] = field(default_factory=dict)
    seed: int = 0


class EngineRunner:
    """The embedded model loaded once on `device`; `run` runs one RunSpec on a fresh Engine."""

    def __init__(self, device: str = "cuda", dtype: str = "auto", model_dir: Optional[str] = None):
        import torch
        from omegaconf import OmegaConf

        from strata.config import EMBEDDED_MODEL_DIR, StrataConfig
        from strata.kernels import ops
        from strata.model.loader import load_checkpoint

        self.device = torch.device(device)
        base = OmegaConf.structured(StrataConfig)
        self.backend = ops.set_backend("auto", self.device.type)
        self.model_dir = model_dir or EMBEDDED_MODEL_DIR
        self.loaded = load_checkpoint(self.model_dir, dtype, self.device, log=lambda s: None,
                                      moe_dense_experts=int(base.model.moe_dense_experts))

    def engine_defaults(self) -> Any:
        """strata's engine config with its own defaults (conf/engine/default.yaml)."""
        from omegaconf import OmegaConf

        from strata.config import StrataConfig

        return OmegaConf.structured(StrataConfig).engine

    def source(self) -> dict[str, Any]:
        """What a profile fitted from these runs records about where it was measured."""
        import torch

        name = (torch.cuda.get_device_name(self.device) if self.device.type == "cuda"
                else "cpu")
        return {"device": name, "torch": torch.__version__, "dtype": str(self.loaded.dtype),
                "backend": self.backend, "commit": commit_id(),
                "date": time.strftime("%Y-%m-%d")}

    def requests(self, spec: RunSpec) -> list:
        """The spec's synthetic prompts (random ids drawn with `spec.seed`), run to max_tokens
        (the simulator runs every request to its budget)."""
        from omegaconf import OmegaConf

        from strata.config import StrataConfig
        from strata.workload import load_workload

        w = OmegaConf.structured(StrataConfig).workload
        w.kind, w.requests, w.prompt_tokens, w.max_tokens = ("synthetic", spec.requests,
                                                             spec.prompt, spec.out)
        w.seed = spec.seed
        reqs = load_workload(w, self.loaded.tokenizer, self.loaded.args.vocab_size)
        for r in reqs:
            r.params.stop_at_eos = False
        return reqs

    def run(self, spec: RunSpec, where: Path, requests: Optional[list] = None,
            trace: bool = True, twin: bool = False) -> dict[str, Any]:
        """Run `spec` (or the given Request objects with its engine and concurrency) on a
        fresh Engine; writes where/trace.jsonl (unless `trace` is false: an engine as served,
        which builds no events) and where/metrics.json; returns the metrics plus `wall_s`
        (the run, without the engine's start) and `start_s`. `twin` (a traced run): the same
        engine then runs the same prompts again with its trace stopped, graphs warm, and
        `untraced_wall_s` is that run's wall (what the traced run would take as served)."""
        import torch

        from strata.engine.llm_engine import Engine
        from strata.runner import run_requests

        where = Path(where)
        where.mkdir(parents=True, exist_ok=True)
        ecfg = self.engine_defaults()
        for k, v in spec.engine.items():
            if not hasattr(ecfg, k):
                raise KeyError(f"engine.{k}: not a key of strata's engine config (run {spec.name})")
            setattr(ecfg, k, v)
        t0 = time.perf_counter()
        eng = Engine(self.loaded, ecfg, self.device, log=lambda s: None,
                     trace_path=where / "trace.jsonl" if trace else None)
        eng.trace.keep = False  # events go to the file only (a traced run keeps none in memory)
        start_s = time.perf_counter() - t0
        try:
            reqs = requests if requests is not None else self.requests(spec)
            # The previous runs' engines (graphs, reference cycles) are collected now, not by
            # a collection that would land inside this timed run.
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            m = run_requests(eng, reqs, concurrency=spec.concurrency)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            wall = time.perf_counter() - t0
            if twin and trace:
                m["untraced_wall_s"] = self._untraced_twin(eng, spec, requests)
        finally:
            eng.close()
        m["device"] = str(self.device)
        m["mode"] = ("solo" if ecfg.mode == "solo" else
                     "batch_mtp" if eng.batch_mtp else "batch")
        (where / "metrics.json").write_text(json.dumps(m, indent=2) + "\n", encoding="utf-8")
        return {**m, "wall_s": wall, "start_s": start_s}

    def _untraced_twin(self, eng: Any, spec: RunSpec, requests: Optional[list]) -> float:
        """The wall of `spec`'s prompts run again on `eng` with its trace stopped."""
        import copy

        import torch

        from strata.runner import run_requests

        eng.trace.flush()
        eng.trace.stop()
        for rid in list(eng.requests):
            eng.release(rid)  # (the traced run's finished requests: their ids come again)
        reqs = ([copy.deepcopy(r) for r in requests] if requests is not None
                else self.requests(spec))
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        run_requests(eng, reqs, concurrency=spec.concurrency)
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0
