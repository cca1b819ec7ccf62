"""`python -m strata [overrides]`: run a workload and write outputs, trace and metrics.

Writes into Hydra's run dir (`hydra.run.dir=DIR`): outputs.jsonl, trace.jsonl, metrics.json.
With no overrides it runs the default workload (4 concurrent code prompts, batch_mtp) on the
embedded tiny model, on the GPU when there is one. `--help` lists every setting; a bad input
is one `error: ...` line and exit code 2.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from strata.cli import CONF_DIR, batch_mtp_env, entry, fail, resolve_batch_mtp, run_mode
from strata.config import ConfigError, register_configs
from strata.engine.request import RequestError
from strata.model.config import CheckpointError
from strata.workload import WorkloadError

register_configs()

#: Lines that frame each printed output, so the completion is told apart from its prompt.
PROMPT_MARK = "--- {id}: prompt"
COMPLETION_MARK = "--- {id}: completion ({reason}, {tokens} tokens)"


def print_outputs(rows: list[dict], prompts: dict[str, str]) -> None:
    def block(text: str) -> None:
        print(text, end="" if text.endswith("\n") else "\n")

    for r in rows:
        prompt = prompts.get(r["id"])
        if prompt is not None:
            print(PROMPT_MARK.format(id=r["id"]))
            block(prompt)
        print(COMPLETION_MARK.format(id=r["id"], reason=r["finish_reason"], tokens=r["output_tokens"]))
        block(r["text"])


def run(cfg: DictConfig, out_dir: Path) -> dict:
    from strata.engine.llm_engine import Engine
    from strata.metrics import format_table
    from strata.runner import run_requests, write_outputs
    from strata.workload import check_workload, load_workload

    log = lambda s: print(s, file=sys.stderr, flush=True)  # noqa: E731
    check_workload(cfg.workload)  # a bad knob fails before the checkpoint is read
    mtp_source = resolve_batch_mtp(cfg)
    with batch_mtp_env(cfg.engine.batch_mtp):
        engine = Engine.from_config(cfg, log=log, trace_path=out_dir / "trace.jsonl")
    try:
        requests = load_workload(cfg.workload, engine.tokenizer, engine.args.vocab_size)
        metrics = run_requests(engine, requests, progress=cfg.progress and sys.stderr.isatty(),
                               concurrency=cfg.workload.concurrency)
        rows = write_outputs(engine, out_dir)
    finally:
        engine.close()
    mode = run_mode(cfg.engine.mode, engine.batch_mtp)
    metrics["device"] = str(engine.device)
    metrics["mode"] = mode
    (out_dir / "metrics.json").write_text(json.dumps(metrics, indent=2) + "\n")
    asked = f"engine.batch_mtp={str(bool(cfg.engine.batch_mtp)).lower()} from {mtp_source}"
    log(f"INFO mode: {mode} (engine.mode={cfg.engine.mode}, {asked})")
    if cfg.print_outputs:
        print_outputs(rows, {q.id: q.prompt_text for q in requests if q.prompt_text is not None})
        print(f"mode: {mode}")
        print(format_table(metrics))
    print(f"outputs: {out_dir}", file=sys.stderr)
    return metrics


@hydra.main(config_path=CONF_DIR, config_name="config", version_base="1.3")
def hydra_main(cfg: DictConfig) -> float:
    out_dir = Path(HydraConfig.get().runtime.output_dir)
    try:
        metrics = run(cfg, out_dir)
    except (ConfigError, CheckpointError, RequestError, WorkloadError) as e:
        fail(str(e))
    return float(metrics["aggregate_tps"] or 0.0)


def main() -> None:
    entry(hydra_main, "python -m strata")


if __name__ == "__main__":
    main()
