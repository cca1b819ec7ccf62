"""Predict: simulate a workload from a cost profile and write the engine's files.

`run_predict(cfg, out_dir)` writes `outputs.jsonl`, `trace.jsonl` and `metrics.json` into
`out_dir` (Hydra's run dir under the CLI). In predict mode `t` is simulated time, so the same
seed and config give a byte-identical trace.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Optional

from omegaconf import DictConfig, OmegaConf

from strata.config import overlap_on, prefill_slots_of
from strata.trace import shape_key, warm_window_keys

from .acceptance import SyntheticAcceptance, build_acceptance
from .config import NOMINAL_PROFILE, SimConfig, SimConfigError, validate
from .costs import CostProfile
from .expert_setup import build_expert_inputs
from .files import read_json
from .graph_cache import MemoryFacts
from .metrics import (COMPARED_FIGURES, compare_metrics, comparison_table, metrics_table,
                      outputs_lines, run_metrics)
from .simulation import Scenario, SimRun, simulate
from .spread import prediction_range
from .streams import RandomStreams
from .trace_acceptance import acceptance_range, fit_from_trace
from .workload import build_workload


def _as_config(cfg: Any) -> SimConfig:
    if isinstance(cfg, SimConfig):
        return cfg
    if isinstance(cfg, DictConfig):
        return OmegaConf.to_object(cfg)
    raise TypeError(f"expected a SimConfig or DictConfig, got {type(cfg).__name__}")


def slots_that_fit(cfg: SimConfig) -> tuple[int, str]:
    """Slots the engine runs and the reason line (docs/SCHEDULING.md, "Slot count")."""
    e, m = cfg.engine, cfg.memory
    asked = 1 if e.mode == "solo" else e.slots
    if e.graph_policy == "upstream":
        return asked, f"INFO slots={asked} (asked {e.slots}): upstream policy sizes no budget"
    # The expert cache's budget is placed with the weights (strata/engine/memory.py).
    room = (m.total_mib - e.vram_reserve_mib - m.weights_mib - e.expert_cache_mib
            - e.graph_mib_estimate)
    fit = math.floor(room / m.slot_mib)
    if fit < 1:
        raise SimConfigError(
            f"memory: no slot fits: total {m.total_mib} - reserve {e.vram_reserve_mib} - weights "
            f"{m.weights_mib} - expert cache {e.expert_cache_mib} - graph estimate "
            f"{e.graph_mib_estimate} MiB leaves {room:.0f} MiB, a slot needs {m.slot_mib} MiB")
    n = min(asked, fit)
    return n, (f"INFO slots={n} (asked {e.slots}): {fit} slots of {m.slot_mib} MiB fit in "
               f"{room:.0f} MiB")


def acceptance_inputs(cfg: SimConfig, profile: CostProfile) -> tuple[Any, Optional[dict]]:
    """The acceptance config and fit a prediction uses: with acceptance.from_trace, the fit
    of that trace (and the config takes its parameters from it, as from a profile), its
    depth factors pooled with the profile's; else the profile's fit."""
    a = cfg.acceptance
    if a.from_trace:
        fit = fit_from_trace(a.from_trace, a.from_trace_requests, prior=profile.acceptance,
                             pin=a.pin_requests)
        if a.model == "chain" and not fit.get("chain"):
            raise SimConfigError(
                f"acceptance.from_trace: {a.from_trace}: no chain fit (its windows judged no "
                "grouped drafts, e.g. one request at a time); use acceptance=position or fixed")
        return replace(a, from_profile=True), fit
    return a, profile.acceptance


def build_scenario(cfg: Any, profile: Optional[CostProfile] = None,
                   acceptance: Optional[tuple[Any, Optional[dict]]] = None
                   ) -> tuple[Scenario, str]:
    """The predict scenario of config `cfg`, and the slot-count info line. `acceptance`:
    (config, fit) as acceptance_inputs returns them (computed when None)."""
    cfg = _as_config(cfg)
    validate(cfg)
    if profile is None:
        profile = CostProfile.load(cfg.profile or NOMINAL_PROFILE)
    acc_cfg, acc_fit = acceptance or acceptance_inputs(cfg, profile)
    streams = RandomStreams(cfg.seed)
    e, m = cfg.engine, cfg.memory
    slots, info = slots_that_fit(cfg)
    if e.synthetic_acceptance is not None:
        info += (f"; acceptance: the engine's synthetic decisions at {e.synthetic_acceptance:g} "
                 f"(engine.synthetic_acceptance; the acceptance group is unused)")
    longest = cfg.workload.prompt_tokens_max
    if longest is not None and longest >= e.max_context:
        info += (f"; WARNING: workload.prompt_tokens_max={longest} reaches engine.max_context="
                 f"{e.max_context}: the engine would refuse the prompts of {e.max_context} "
                 f"tokens or more, which this prediction runs to the context end")
    capture_gen = streams.stream("graph.capture_mib")

    def measure_capture() -> float:
        if m.graph_mib_jitter == 0:
            return m.graph_mib
        return round(float(capture_gen.uniform(m.graph_mib - m.graph_mib_jitter,
                                               m.graph_mib + m.graph_mib_jitter)), 3)

    experts = build_expert_inputs(cfg, streams, profile.source.get("scaled"))
    memory = MemoryFacts(total_mib=m.total_mib,
                         weights_mib=m.weights_mib + e.expert_cache_mib, slot_mib=m.slot_mib,
                         slots=slots, reserve_mib=e.vram_reserve_mib,
                         graph_mib_estimate=e.graph_mib_estimate,
                         runtime_overhead_mib=m.runtime_overhead_mib)
    scenario = Scenario(
        knobs=e, memory=memory, slots=slots,
        requests=build_workload(cfg.workload, streams),
        # engine.synthetic_acceptance replaces the model's drafts' acceptance, as in the engine
        acceptance=(acceptance_model(cfg, acc_cfg, streams, acc_fit)
                    if e.synthetic_acceptance is None
                    else SyntheticAcceptance(float(e.synthetic_acceptance))),
        costs=profile.for_slots(slots),  # (window times depend on the slot count: sim/costs.py)
        measure_capture=measure_capture,
        config_engine={**asdict(e),  # overlap and prefill_slots resolved, as the engine's
                       "overlap": overlap_on(e), "prefill_slots": prefill_slots_of(e)},
        config_memory={"total_mib": m.total_mib, "weights_mib": m.weights_mib + e.expert_cache_mib,
                       "slot_mib": m.slot_mib, "slots": slots, "graph_mib": m.graph_mib,
                       **(experts.memory_fields if experts else {})},
        max_steps=cfg.max_steps,
        warm_keys=warm_keys(e, slots),
        experts=experts.model if experts else None,
        expert_costs=experts.costs if experts else None)
    return scenario, info


def acceptance_model(cfg: SimConfig, acc_cfg: Any, streams: RandomStreams,
                     fit: Optional[dict]) -> Any:
    """build_acceptance, whose errors are the user's: a model the profile's (or the trace's)
    fit cannot give, or a hand-edited `acceptance` section."""
    source = cfg.acceptance.from_trace or cfg.profile or NOMINAL_PROFILE
    try:
        return build_acceptance(acc_cfg, streams, fit)
    except ValueError as e:
        raise SimConfigError(f"{source}: {e}") from None
    except KeyError as e:
        raise SimConfigError(f"{source}: the `acceptance` section lacks {e.args[0]!r}") from None
    except TypeError as e:
        raise SimConfigError(f"{source}: the `acceptance` section has a value of the wrong "
                             f"type ({e})") from None


def warm_keys(e: Any, slots: int) -> list[str]:
    """The window graphs the engine's warm-up captures (engine.warmup_graphs), in order."""
    if not (e.warmup_graphs and e.graphs and e.graph_key == "shape"):
        return []
    spec = int(e.spec) if e.drafting else 1
    most_rows = max(spec, 2 if (e.batch_mtp and e.drafting) else 1)
    return [shape_key(b, g, tier) for b, g, tier in
            warm_window_keys(slots, most_rows, int(e.window_rows), list(e.shape_buckets),
                             int(e.context_tier_min), int(e.max_context),
                             bool(e.batch_invariant))]


@dataclass
class PredictResult:
    run: SimRun
    metrics: dict[str, Any]
    info: str


def run_predict(cfg: Any, out_dir: Optional[str | Path] = None,
                profile: Optional[CostProfile] = None) -> PredictResult:
    """Simulate; with `out_dir`, write outputs.jsonl, trace.jsonl and metrics.json there.
    With spread.enabled, metrics.json has a `range` section (sim/spread.py)."""
    cfg = _as_config(cfg)
    validate(cfg)
    if profile is None:
        profile = CostProfile.load(cfg.profile or NOMINAL_PROFILE)
    acceptance = acceptance_inputs(cfg, profile)
    scenario, info = build_scenario(cfg, profile, acceptance)
    if out_dir is None:
        run = simulate(scenario)
    else:
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        with open(out / "trace.jsonl", "w", encoding="utf-8") as f:
            run = simulate(scenario, trace_stream=f)
    metrics = run_metrics(run)
    # From a few requests' trace, where the workload's acceptance may lie (None else).
    acc_cfg, acc_fit = acceptance
    metrics["acceptance_range"] = acceptance_range(
        lambda fit: run_metrics(simulate(build_scenario(cfg, profile, (acc_cfg, fit))[0]))[
            "acceptance"], acc_fit)
    if cfg.spread.enabled:
        profiles = [(cfg.profile or NOMINAL_PROFILE, profile)] + [
            (p, CostProfile.load(p)) for p in cfg.spread.profiles]
        metrics["range"] = prediction_range(
            cfg.spread, profiles, metrics,
            lambda prof: run_metrics(simulate(build_scenario(cfg, prof, acceptance)[0])))
    if out_dir is not None:
        with open(out / "outputs.jsonl", "w", encoding="utf-8") as f:
            for line in outputs_lines(run):
                f.write(json.dumps(line, separators=(",", ":")) + "\n")
        (out / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n", encoding="utf-8")
    return PredictResult(run=run, metrics=metrics, info=info)


def load_engine_metrics(path: str | Path) -> dict[str, Any]:
    p = Path(path)
    m = read_json(p, "engine metrics", SimConfigError, prefix="compare_with: ")
    # Another file (outputs.jsonl's line, comparison.json) would print a table of dashes.
    if not isinstance(m, dict):
        raise SimConfigError(f"compare_with: {p}: must be a JSON object (an engine metrics.json)")
    found = False
    for _, path_of in COMPARED_FIGURES:
        v = m
        for k in path_of:
            v = v.get(k) if isinstance(v, dict) else None
        if v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))):
            raise SimConfigError(f"compare_with: {p}: {'.'.join(path_of)} must be a number, "
                                 f"got {v!r}")
        found = found or v is not None
    if not found:
        raise SimConfigError(f"compare_with: {p}: none of the compared figures ("
                             f"{', '.join('.'.join(f) for _, f in COMPARED_FIGURES)}): not an "
                             f"engine metrics.json?")
    return m


def main_predict(cfg: DictConfig, out_dir: str) -> int:
    engine_metrics = load_engine_metrics(cfg.compare_with) if cfg.compare_with else None
    result = run_predict(cfg, out_dir)
    if cfg.print_outputs:
        print(result.info)
        print(metrics_table(result.metrics))
        print(f"wrote {out_dir}/outputs.jsonl, trace.jsonl, metrics.json")
    if engine_metrics is not None:
        rows = compare_metrics(engine_metrics, result.metrics)
        print(comparison_table(rows))
        (Path(out_dir) / "comparison.json").write_text(json.dumps(
            [{"figure": f, "engine": e, "sim": s, "error": err} for f, e, s, err in rows],
            indent=1) + "\n", encoding="utf-8")
    return 0
