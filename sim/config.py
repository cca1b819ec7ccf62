"""Structured-config schemas of the simulator (`python -m sim`).

Every knob the simulator has is a field here; the YAML files under conf/sim/ only choose
values. The schemas are registered in Hydra's ConfigStore under names prefixed `sim_`, so they
never collide with strata's own schemas when both packages are imported in one process, and an
override naming an unknown key (or a value of the wrong type) is an error.

The engine knobs mirror strata's `engine` group (DESIGN.md section 8) field for field, so a
study can sweep the same names it would pass to `python -m strata`; `drafting` and
`graph_policy` are the simulator's own additions (see the field comments).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import OmegaConf

#: The simulator's Hydra config tree (its own primary config.yaml and groups).
SIM_CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf" / "sim")
#: The cost profile used when `profile` is null: illustrative numbers, not a measurement.
NOMINAL_PROFILE = str(Path(SIM_CONF_DIR) / "profiles" / "nominal.json")

MODES = ("predict", "replay")
ENGINE_MODES = ("solo", "batch")
GRAPH_KEYS = ("shape", "layout")
GRAPH_POLICIES = ("counted", "upstream")
WORKLOAD_KINDS = ("poisson", "burst", "cohort", "stagger")
ACCEPTANCE_MODELS = ("fixed", "markov", "position", "chain")


@dataclass
class SimEngineConfig:
    #: solo: one request at a time; batch: up to `slots` requests share windows.
    mode: str = "batch"
    #: Grouped MTP verification in batch slots (2-row groups).
    batch_mtp: bool = True
    #: Drafting is available (MTP weights present, spec >= 2, draft state fits). The engine
    #: decides this at start-up and records it in the trace; the simulator takes it as given.
    drafting: bool = True
    #: Decoding lanes asked for; the simulator, like the engine, runs what fits in memory.
    slots: int = 4
    #: Verify rows per solo step (1 = no speculation); also a lone batch slot's window.
    spec: int = 4
    #: Rows of one verifier forward (W).
    window_rows: int = 8
    #: Share of iterations that are decode windows while prefill and decode both wait.
    decode_share: float = 0.5
    #: Prompt tokens per prefill iteration.
    prefill_chunk: int = 256
    #: Lengths a prompt chunk is padded to (its device time is that of the padded length; past
    #: the last bucket a chunk runs unpadded). Empty: chunks run unpadded.
    prefill_buckets: list[int] = field(default_factory=lambda: [16, 32, 64, 128, 256])
    #: Context length of a slot (positions 0 .. max_context-1).
    max_context: int = 4096
    #: Smallest context tier; tiers double from here up to max_context.
    context_tier_min: int = 256
    #: Groups-per-window buckets of the `shape` graph key (ascending).
    shape_buckets: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16])
    #: Run windows by replaying captured graphs.
    graphs: bool = True
    #: Graph-cache key: `shape` (bucket + tier) or `layout` (exact layout + tier).
    graph_key: str = "shape"
    #: Every window runs exactly `window_rows` rows (as the engine's knob of the same name):
    #: groups padded to window_rows // rows, rows per group rounded up to a divisor of it.
    batch_invariant: bool = False
    #: Most graphs kept (LRU); 0 = unbounded.
    graph_limit: int = 32
    #: Device memory kept free, never planned for (MiB).
    vram_reserve_mib: int = 2048
    #: Planned size of a graph before any capture was measured (MiB).
    graph_mib_estimate: float = 16.0
    #: The engine's warm-up captured the shape-keyed window graphs before any request
    #: (strata.trace.warm_window_keys; strata does this when engine.warmup runs, which `auto`
    #: does on CUDA). Only with graphs and graph_key=shape.
    warmup_graphs: bool = False
    #: counted: strata's policy (graph memory is budgeted; a graph that does not fit runs
    #: eagerly). upstream: the upstream engine's (graph memory is not counted; a capture that
    #: finds no free memory fails and the engine exits, failing the requests in flight).
    graph_policy: str = "counted"


@dataclass
class SimMemoryConfig:
    #: Device memory (MiB).
    total_mib: float = 24564.0
    #: Model weights and anything else resident before slots are sized (MiB).
    weights_mib: float = 18000.0
    #: One slot's state: KV + DeltaNet states + draft state (MiB).
    slot_mib: float = 512.0
    #: Device memory one graph capture takes (MiB), the mean of the draws below.
    graph_mib: float = 22.0
    #: Captures draw their size uniformly from graph_mib +- this (MiB); 0 = every capture the
    #: same. The upstream reports saw 20-25 MiB per new layout.
    graph_mib_jitter: float = 0.0
    #: upstream policy only: device memory taken after start-up by allocations other than
    #: graphs (workspaces, allocator slack) out of the reserve (MiB).
    runtime_overhead_mib: float = 0.0


@dataclass
class SimWorkloadConfig:
    #: poisson: exponential gaps at `rate_per_s`; burst: waves of `burst_size`..`burst_size_max`
    #: requests every `burst_gap_s`, spread over `burst_spread_s`; cohort: `requests`
    #: concurrent requests at t=0 (the upstream users' paired runs); stagger: request i arrives
    #: at step i * stagger_steps (the engine's synthetic workload).
    kind: str = "poisson"
    requests: int = 16
    #: Prompt length; uniform in [prompt_tokens, prompt_tokens_max] when the max is set.
    prompt_tokens: int = 512
    prompt_tokens_max: Optional[int] = None
    #: Output budget; uniform in [max_tokens, max_tokens_max] when the max is set.
    max_tokens: int = 128
    max_tokens_max: Optional[int] = None
    rate_per_s: float = 1.0
    burst_size: int = 4
    burst_size_max: Optional[int] = None
    burst_gap_s: float = 10.0
    burst_spread_s: float = 0.0
    stagger_steps: int = 0
    #: Share of requests that sample with top-k / top-p (each drawn independently): windows
    #: holding one use the filtering sampler, a separate graph (key suffix `+f`).
    filtered_share: float = 0.0
    #: 0: every request arrives as `kind` says. k >= 1: a closed loop of k clients (the
    #: engine's workload.concurrency): the first k arrive as `kind` says, and each later one in
    #: the iteration after an earlier request finishes.
    concurrency: int = 0


@dataclass
class SimAcceptanceConfig:
    #: fixed: every draft is accepted with probability `rate`, independently; markov: the
    #: outcome of a draft depends on the outcome of the request's previous draft.
    model: str = "fixed"
    rate: float = 0.7
    #: markov: P(accept | the request's previous draft was accepted / was rejected / is its
    #: first draft).
    p_accept_after_accept: float = 0.8
    p_accept_after_reject: float = 0.5
    p_accept_first: float = 0.7
    #: position: the rate of each bucket of `position_tokens` output positions (the last one
    #: holds past the end); empty = `rate` everywhere.
    position_rates: list[float] = field(default_factory=list)
    position_tokens: int = 16
    #: position: factor on the rate of a group's 1st, 2nd, ... draft (the last one holds
    #: deeper); empty = 1 at every depth.
    position_depth_factors: list[float] = field(default_factory=list)
    #: Take the parameters of `model` from the cost profile's fitted `acceptance` section.
    from_profile: bool = False
    #: chain: give each request its own difficulty, as the profile fitted it (`chain.spread`,
    #: `chain.offset`); false = every request sees the same rates.
    request_spread: bool = True
    #: An engine trace (trace.jsonl) of the user's own workload: the model's parameters are
    #: fitted from its commits instead of the profile's (implies from_profile's use of a fit).
    from_trace: Optional[str] = None
    #: With from_trace: fit from the trace's first this many requests only (in admission
    #: order); 0 = all of them.
    from_trace_requests: int = 0


@dataclass
class SimSpreadConfig:
    """The range a prediction reports besides its point (sim/spread.py)."""
    #: Report a range at all (each end is one more simulation of the workload).
    enabled: bool = True
    #: Quantiles of the profile's per-run speed factors (source.trace_speeds) that price the
    #: fast and the slow end: every window, prompt chunk and host gap at that speed.
    quantiles: list[float] = field(default_factory=lambda: [0.1, 0.9])
    #: Stated speed difference between machines of the same kind, beyond the runs the profile
    #: saw (a fraction: 0.2 = the fast end 20% faster, the slow end 20% slower). A hardware
    #: preset states it from its own evidence; a profile calibrated on this machine needs none.
    machine: float = 0.0
    #: More cost profiles of the same hardware (other machines, other calls): the range is
    #: the envelope of every profile's range.
    profiles: list[str] = field(default_factory=list)


@dataclass
class SimHardwareConfig:
    """What a hardware preset (conf/sim/hardware/NAME.yaml) says about itself; the preset
    sets `profile`, the `memory` group, engine defaults and `spread` through the global
    package. Empty when no preset is chosen."""
    #: The preset's name (the file's stem).
    name: str = ""
    #: Free text: the device, dtype, model and where the profile comes from.
    description: str = ""


@dataclass
class SimConfig:
    #: predict: simulate a workload from a cost profile; replay: re-run an engine trace.
    mode: str = "predict"
    #: replay: the engine trace (JSON Lines) to reproduce.
    trace: Optional[str] = None
    #: predict: cost profile JSON (null = conf/sim/profiles/nominal.json, illustrative).
    profile: Optional[str] = None
    #: predict: an engine metrics.json of the same workload; prints the prediction's error per
    #: figure (aggregate tok/s, TTFT and E2E percentiles).
    compare_with: Optional[str] = None
    #: Root seed; each random input draws from its own stream derived from it.
    seed: int = 0
    #: Print the metrics table (predict) or the summary line (replay).
    print_outputs: bool = True
    #: Safety stop: a simulation that runs this many iterations is an error, not a hang.
    max_steps: int = 2_000_000
    engine: SimEngineConfig = field(default_factory=SimEngineConfig)
    memory: SimMemoryConfig = field(default_factory=SimMemoryConfig)
    workload: SimWorkloadConfig = field(default_factory=SimWorkloadConfig)
    acceptance: SimAcceptanceConfig = field(default_factory=SimAcceptanceConfig)
    spread: SimSpreadConfig = field(default_factory=SimSpreadConfig)
    hardware: SimHardwareConfig = field(default_factory=SimHardwareConfig)


class SimConfigError(ValueError):
    """A simulator configuration value that cannot run (names the key and the problem)."""


def register_configs() -> None:
    cs = ConfigStore.instance()
    cs.store(name="sim_schema", node=SimConfig)
    cs.store(group="engine", name="sim_engine_schema", node=SimEngineConfig)
    cs.store(group="memory", name="sim_memory_schema", node=SimMemoryConfig)
    cs.store(group="workload", name="sim_workload_schema", node=SimWorkloadConfig)
    cs.store(group="acceptance", name="sim_acceptance_schema", node=SimAcceptanceConfig)
    if not OmegaConf.has_resolver("sim_conf"):
        # `${sim_conf:profiles/X.json}`: a path under conf/sim/, as hardware presets name
        # their profile wherever the simulator runs from.
        OmegaConf.register_new_resolver("sim_conf", lambda rel: str(Path(SIM_CONF_DIR) / rel))


def validate_engine(e: Any) -> None:
    """Check engine knobs a schema cannot express (the same rules as the engine's)."""
    def bad(key: str, msg: str) -> None:
        raise SimConfigError(f"engine.{key}: {msg}")

    if e.mode not in ENGINE_MODES:
        bad("mode", f"must be one of {ENGINE_MODES}, got {e.mode!r}")
    if e.graph_key not in GRAPH_KEYS:
        bad("graph_key", f"must be one of {GRAPH_KEYS}, got {e.graph_key!r}")
    if e.graph_policy not in GRAPH_POLICIES:
        bad("graph_policy", f"must be one of {GRAPH_POLICIES}, got {e.graph_policy!r}")
    if e.slots < 1:
        bad("slots", f"must be >= 1, got {e.slots}")
    if e.window_rows < 1:
        bad("window_rows", f"must be >= 1, got {e.window_rows}")
    if e.spec < 1:
        bad("spec", f"must be >= 1, got {e.spec}")
    if e.spec > e.window_rows:
        bad("spec", f"engine.spec={e.spec} exceeds engine.window_rows={e.window_rows}")
    if e.batch_mtp and e.drafting and e.mode == "batch" and e.window_rows < 2:
        bad("window_rows", f"batch_mtp needs 2-row groups, engine.window_rows={e.window_rows}")
    if not 0.0 < e.decode_share <= 1.0:
        bad("decode_share", f"must be in (0, 1], got {e.decode_share}")
    if e.prefill_chunk < 1:
        bad("prefill_chunk", f"must be >= 1, got {e.prefill_chunk}")
    pb = list(e.prefill_buckets)
    if pb and (pb != sorted(set(pb)) or pb[0] < 1):
        bad("prefill_buckets", f"must be ascending distinct positive ints, got {pb}")
    if e.graph_limit < 0:
        bad("graph_limit", f"must be >= 0 (0 = unbounded), got {e.graph_limit}")
    if e.vram_reserve_mib < 0:
        bad("vram_reserve_mib", f"must be >= 0, got {e.vram_reserve_mib}")
    if e.max_context < 2:
        bad("max_context", f"must be >= 2, got {e.max_context}")
    if e.context_tier_min < 1:
        bad("context_tier_min", f"must be >= 1, got {e.context_tier_min}")
    buckets = list(e.shape_buckets)
    if not buckets or buckets != sorted(set(buckets)) or buckets[0] < 1:
        bad("shape_buckets", f"must be ascending distinct positive ints, got {buckets}")


def validate_memory(m: Any) -> None:
    def bad(key: str, msg: str) -> None:
        raise SimConfigError(f"memory.{key}: {msg}")

    for key in ("total_mib", "weights_mib", "slot_mib", "graph_mib", "graph_mib_jitter",
                "runtime_overhead_mib"):
        if getattr(m, key) < 0:
            bad(key, f"must be >= 0, got {getattr(m, key)}")
    if m.slot_mib == 0:
        bad("slot_mib", "must be > 0")
    if m.graph_mib_jitter > m.graph_mib:
        bad("graph_mib_jitter", f"{m.graph_mib_jitter} exceeds graph_mib={m.graph_mib}")


def validate_workload(w: Any) -> None:
    def bad(key: str, msg: str) -> None:
        raise SimConfigError(f"workload.{key}: {msg}")

    if w.kind not in WORKLOAD_KINDS:
        bad("kind", f"must be one of {WORKLOAD_KINDS}, got {w.kind!r}")
    if w.requests < 1:
        bad("requests", f"must be >= 1, got {w.requests}")
    for lo, hi in (("prompt_tokens", "prompt_tokens_max"), ("max_tokens", "max_tokens_max"),
                   ("burst_size", "burst_size_max")):
        if getattr(w, lo) < 1:
            bad(lo, f"must be >= 1, got {getattr(w, lo)}")
        if getattr(w, hi) is not None and getattr(w, hi) < getattr(w, lo):
            bad(hi, f"{getattr(w, hi)} is below {lo}={getattr(w, lo)}")
    if w.kind == "poisson" and w.rate_per_s <= 0:
        bad("rate_per_s", f"must be > 0, got {w.rate_per_s}")
    if w.burst_gap_s < 0 or w.burst_spread_s < 0:
        bad("burst_gap_s", "burst_gap_s and burst_spread_s must be >= 0")
    if w.stagger_steps < 0:
        bad("stagger_steps", f"must be >= 0, got {w.stagger_steps}")
    if not 0.0 <= w.filtered_share <= 1.0:
        bad("filtered_share", f"must be in [0, 1], got {w.filtered_share}")
    if w.concurrency < 0:
        bad("concurrency", f"must be >= 0 (0 = no closed loop), got {w.concurrency}")


def validate_acceptance(a: Any) -> None:
    if a.model not in ACCEPTANCE_MODELS:
        raise SimConfigError(f"acceptance.model: must be one of {ACCEPTANCE_MODELS}, got {a.model!r}")
    for key in ("rate", "p_accept_after_accept", "p_accept_after_reject", "p_accept_first"):
        v = getattr(a, key)
        if not 0.0 <= v <= 1.0:
            raise SimConfigError(f"acceptance.{key}: must be in [0, 1], got {v}")
    if any(not 0.0 <= v <= 1.0 for v in a.position_rates):
        raise SimConfigError(f"acceptance.position_rates: must be in [0, 1], got {list(a.position_rates)}")
    if any(v < 0 for v in a.position_depth_factors):
        raise SimConfigError(f"acceptance.position_depth_factors: must be >= 0, got "
                             f"{list(a.position_depth_factors)}")
    if a.position_tokens < 1:
        raise SimConfigError(f"acceptance.position_tokens: must be >= 1, got {a.position_tokens}")
    if a.from_trace_requests < 0:
        raise SimConfigError(f"acceptance.from_trace_requests: must be >= 0 (0 = all), got "
                             f"{a.from_trace_requests}")
    if a.from_trace_requests and not a.from_trace:
        raise SimConfigError("acceptance.from_trace_requests: needs acceptance.from_trace=FILE")


def validate_spread(s: Any) -> None:
    q = list(s.quantiles)
    if len(q) != 2 or not 0.0 <= q[0] <= q[1] <= 1.0:
        raise SimConfigError(f"spread.quantiles: must be two ascending numbers in [0, 1], got {q}")
    if not 0.0 <= s.machine < 1.0:
        raise SimConfigError(f"spread.machine: must be in [0, 1), got {s.machine}")


def validate(cfg: Any) -> None:
    if cfg.mode not in MODES:
        raise SimConfigError(f"mode: must be one of {MODES}, got {cfg.mode!r}")
    if cfg.mode == "replay" and not cfg.trace:
        raise SimConfigError("trace: mode=replay needs trace=FILE (an engine trace.jsonl)")
    if cfg.max_steps < 1:
        raise SimConfigError(f"max_steps: must be >= 1, got {cfg.max_steps}")
    validate_engine(cfg.engine)
    validate_memory(cfg.memory)
    validate_workload(cfg.workload)
    validate_acceptance(cfg.acceptance)
    validate_spread(cfg.spread)
