"""`python -m strata [overrides]`: run a workload and write outputs, trace and metrics.

Writes into Hydra's run dir (`hydra.run.dir=DIR`): outputs.jsonl, trace.jsonl, metrics.json.
With no overrides it runs the default workload (4 concurrent code prompts, batch_mtp) on the
embedded tiny model, on the GPU when there is one.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from strata.config import ConfigError, register_configs
from strata.engine.request import RequestError
from strata.model.config import CheckpointError
from strata.workload import WorkloadError

CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf")
register_configs()


def run(cfg: DictConfig, out_dir: Path) -> dict:
    from strata.engine.llm_engine import Engine
    from strata.metrics import format_table
    from strata.runner import run_requests, write_outputs
    from strata.workload import check_workload, load_workload

    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    check_workload(cfg.workload)  # a bad knob fails before the checkpoint is read
    engine = Engine.from_config(cfg, log=log, trace_path=out_dir / "trace.jsonl")
    try:
        requests = load_workload(cfg.workload, engine.tokenizer, engine.args.vocab_size)
        metrics = run_requests(engine, requests, progress=cfg.progress and sys.stderr.isatty(),
                               concurrency=cfg.workload.concurrency)
        rows = write_outputs(engine, out_dir)
    finally:
        engine.close()
    metrics["device"] = str(engine.device)
    metrics["mode"] = "solo" if cfg.engine.mode == "solo" else ("batch_mtp" if engine.batch_mtp else "batch")
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    if cfg.print_outputs:
        for r in rows:
            prompt = next(q.prompt_text for q in requests if q.id == r["id"])
            print(f"--- {r['id']} ({r['finish_reason']}, {r['output_tokens']} tokens)")
            print((prompt or "") + r["text"])
        print(format_table(metrics))
    print(f"outputs: {out_dir}", file=sys.stderr)
    return metrics


@hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> float:
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        metrics = run(cfg, out_dir)
    except (ConfigError, CheckpointError, RequestError, WorkloadError) as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    return float(metrics["aggregate_tps"] or 0.0)


if __name__ == "__main__":
    main()
