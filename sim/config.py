"""Structured-config schemas of the simulator (`python -m sim`).

Every knob the simulator has is a field here; the YAML files under conf/sim/ only choose
values. The schemas are registered in Hydra's ConfigStore under names prefixed `sim_`, so they
never collide with strata's own schemas when both packages are imported in one process, and an
override naming an unknown key (or a value of the wrong type) is an error.

The engine knobs are strata's `engine` schema (DESIGN.md section 8), extended, with strata's
validator, so a study sweeps the same names, defaults and rules it would pass to `python -m
strata`; `drafting`, `warmup_graphs` and `graph_policy` are the simulator's own additions.
Likewise the workload's requests, sizes and arrival knobs are strata's WorkloadBaseConfig, with
its validator; the arrival processes (poisson, burst, cohort) are the simulator's own.
Only the schema, its validation, the trace schema and the metric definitions are shared: the
scheduling rules are implemented again in sim/, which is what a replay checks.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Optional

from omegaconf import OmegaConf

from strata.config import (ConfigError, EngineConfig, WorkloadBaseConfig, store_schemas,
                           validate_workload_base)
from strata.config import validate_engine as validate_strata_engine

#: The simulator's Hydra config tree (its own primary config.yaml and groups).
SIM_CONF_DIR = str(Path(__file__).resolve().parent.parent / "conf" / "sim")
#: The cost profile used when `profile` is null: illustrative numbers, not a measurement.
NOMINAL_PROFILE = str(Path(SIM_CONF_DIR) / "profiles" / "nominal.json")

MODES = ("predict", "replay")
GRAPH_POLICIES = ("counted", "upstream")
WORKLOAD_KINDS = ("poisson", "burst", "cohort", "stagger")
ACCEPTANCE_MODELS = ("fixed", "markov", "position", "chain")
EXPERT_COSTS = ("profile", "bytes")


@dataclass
class SimEngineConfig(EngineConfig):
    """strata's engine schema (the same knobs, defaults and validation), plus what only a
    simulation chooses. Knobs that concern the engine's host side alone (compile, warmup,
    gc_freeze, vram_every, cpu_*) are accepted and have no effect on a simulation."""

    #: Drafting is available (MTP weights present, spec >= 2, draft state fits). The engine
    #: decides this at start-up and records it in the trace; the simulator takes it as given.
    drafting: bool = True
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
    """The card's and the host link's facts (conf/sim/memory/*.yaml, chosen alone or by a
    hardware preset; `python -m sim calibrate` measures the device, weights, slot and graph
    sizes). Sizes, bandwidths and link counts: none may be negative."""
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
    #: Device memory bandwidth, the card's specification (GB/s); the expert model prices
    #: device-resident bytes at experts.hbm_efficiency of it (needed when experts.experts > 0).
    #: 0 = unknown.
    hbm_gb_s: float = 0.0
    #: Host -> device link's PCIe generation (0 = unknown), documenting where bus_gb_s comes
    #: from (the simulation does not use it).
    pcie_gen: int = 0
    #: Host -> device link's PCIe lane count, documenting where bus_gb_s comes from (the
    #: simulation does not use it).
    pcie_lanes: int = 16
    #: Pinned host -> device bandwidth (GB/s) a missed expert is read at and an expert swap
    #: copies at; 0 = unknown (not allowed with engine.expert_cache_mib > 0).
    bus_gb_s: float = 0.0


#: Every memory fact, from the schema (so a new one is checked too): none may be negative.
MEMORY_FACTS = tuple(f.name for f in fields(SimMemoryConfig))


@dataclass
class SimWorkloadConfig(WorkloadBaseConfig):
    """strata's shared workload knobs (requests, prompt_tokens, max_tokens, stagger_steps,
    concurrency: the engine's names, meanings and defaults), plus how a simulation draws
    arrivals and sizes. conf/sim/workload/*.yaml set the sizes of each kind."""

    #: poisson: exponential gaps at `rate_per_s`; burst: waves of `burst_size`..`burst_size_max`
    #: requests every `burst_gap_s`, spread over `burst_spread_s`; cohort: `requests`
    #: concurrent requests at t=0 (the upstream users' paired runs); stagger: request i arrives
    #: at step i * stagger_steps (the engine's synthetic workload).
    kind: str = "poisson"
    #: Prompt lengths are uniform in [prompt_tokens, prompt_tokens_max]; null = all prompt_tokens.
    prompt_tokens_max: Optional[int] = None
    #: Output budgets are uniform in [max_tokens, max_tokens_max]; null = all max_tokens.
    max_tokens_max: Optional[int] = None
    #: kind=poisson: mean arrivals per second.
    rate_per_s: float = 1.0
    #: kind=burst: requests per wave; with burst_size_max, each wave's size is drawn
    #: uniformly from [burst_size, burst_size_max].
    burst_size: int = 4
    #: kind=burst: the largest wave (inclusive); null = every wave has burst_size requests.
    burst_size_max: Optional[int] = None
    #: kind=burst: seconds between the starts of consecutive waves (wave i starts at
    #: i * burst_gap_s).
    burst_gap_s: float = 10.0
    #: kind=burst: each request of a wave arrives uniformly within this many seconds after the
    #: wave's start; 0 = the whole wave at once.
    burst_spread_s: float = 0.0
    #: Share of requests that sample with top-k / top-p (each drawn independently): windows
    #: holding one use the filtering sampler, a separate graph (key suffix `+f`).
    filtered_share: float = 0.0
    #: The requests' sampling seeds, which key engine.synthetic_acceptance's decisions: null =
    #: the engine's default, seed 0 for every request (a server's requests that name none;
    #: scripts/bench_engine.py's cohorts unless --request-seeds), so requests of one prompt
    #: length draw the same decisions; k = request i takes seed k + i (the engine's
    #: workload.seed for kind=default and synthetic; bench_engine.py --request-seeds k).
    request_seeds: Optional[int] = None


@dataclass
class SimAcceptanceConfig:
    """How many of a group's drafts the verifier accepts: one of sim/acceptance.py's models
    (conf/sim/acceptance/*.yaml pick one), its parameters stated or fitted (profile, trace)."""
    #: fixed: every draft is accepted with probability `rate`, independently; markov: the
    #: outcome of a draft depends on the outcome of the request's previous draft; position:
    #: the rate depends on the draft's output position and depth; chain: a fitted chain over
    #: output positions (needs from_profile).
    model: str = "fixed"
    #: fixed: the probability each judged draft is accepted; position: the rate everywhere
    #: when position_rates is empty (from_profile: the profile's fitted rate instead).
    rate: float = 0.7
    #: markov: P(accept) of a draft when the request's previous judged draft was accepted.
    p_accept_after_accept: float = 0.8
    #: markov: P(accept) of a draft when the request's previous judged draft was rejected.
    p_accept_after_reject: float = 0.5
    #: markov: P(accept) of a request's first judged draft.
    p_accept_first: float = 0.7
    #: position: the rate of each bucket of `position_tokens` output positions (the last one
    #: holds past the end); empty = `rate` everywhere.
    position_rates: list[float] = field(default_factory=list)
    #: position: the width of each position_rates bucket, in output tokens (from_profile: the
    #: profile's bucket width instead).
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
    #: chain, with from_trace: the simulated requests 0 .. k-1 take the difficulties of the
    #: trace's first k admitted requests, each fitted to that request's own acceptance
    #: (sim.acceptance.pin_difficulties), the rest drawn as usual: for the traced requests
    #: themselves (their cohort replayed under the cost model), not a new draw of the workload.
    pin_requests: bool = False


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
class SimExpertsConfig:
    """The model's routed experts and the expert cache's costs (issue 17; sim/experts.py,
    sim/expert_costs.py). `experts` = 0: no expert model (every window costs what the
    profile says). The cache's size and adapt period are strata's engine.expert_cache_mib,
    engine.expert_adapt_every and engine.expert_profile."""
    #: Routed experts per MoE layer (0 = no expert model).
    experts: int = 0
    #: Experts each row (token) routes to in each MoE layer, in [1, experts].
    top_k: int = 1
    #: MoE layers of the model (each holds its own expert cache slots).
    moe_layers: int = 1
    #: Bytes of one routed expert's weights and scales (what a miss reads over the bus, a
    #: swap copies and a cache slot holds).
    expert_bytes: int = 0
    #: Routing without engine.expert_profile: expert e's popularity ~ (e+1)^-skew (the
    #: engine's model.dummy_routing_skew; 0 = uniform).
    skew: float = 0.0
    #: Within a group (one request's consecutive positions), the chance that each of a row's
    #: top_k picks repeats the previous row's (trained routers route neighbouring tokens
    #: alike; the engine's random dummy routers do not: 0).
    row_overlap: float = 0.0
    #: Adaptive swap, as strata/engine/expert_cache.py runs it: each adaptation multiplies the
    #: decayed counts by this before adding the picks since the last one (the engine's DECAY).
    decay: float = 0.75
    #: Adaptive swap: the most experts moved per layer at each adaptation (0 = no limit; the
    #: engine moves one).
    swap_limit: int = 1
    #: Rows of one MoE kernel call (strata's MOE_MAX_ROWS): a forward of more rows runs
    #: several calls, and each reads a missed expert it routes to over the bus (0 = one call).
    call_rows: int = 32
    #: Without the expert cache: rows of one routed-expert launch in a prompt chunk (strata's
    #: FP8 wide launches: 64); a chunk of more rows (a long prompt's, or several slots' with
    #: engine.prefill_slots) reads each launch's distinct experts, not the chunk's once (0 =
    #: one launch a chunk).
    prefill_launch_rows: int = 0
    #: profile: the cost profile's window plus each miss's bus time less its HBM time;
    #: bytes: the real-scale bytes model below (sim/expert_costs.py).
    cost: str = "profile"
    #: bytes model: the model's decoder layers, all of them (each costs per_layer_s).
    layers: int = 1
    #: bytes model: fixed device seconds of each layer in a forward, besides its bytes.
    per_layer_s: float = 0.0
    #: The share of memory.hbm_gb_s device-resident bytes are read at (both cost models: the
    #: bytes model's window and profile's HBM time of a missed expert), in (0, 1].
    hbm_efficiency: float = 1.0
    #: bytes model: non-expert bytes every window reads (dense weights, head, MTP, KV, state).
    other_base_bytes: float = 0.0
    #: bytes model: non-expert bytes a window reads per group, on top of other_base_bytes.
    other_per_group_bytes: float = 0.0
    #: bytes model: non-expert bytes per MTP draft step past the second row of a group (times
    #: max(0, the group's rows - 2)).
    other_per_draft_bytes: float = 0.0
    #: bytes model: the rows a decode window's row-count-bound kernels take a launch (strata's
    #: FP8 linear and router: 16, and above 16 rows the gate/up kernel reads x from L2 instead
    #: of shared memory); 0: no such limit.
    launch_rows: int = 0
    #: bytes model: seconds each decoder layer adds for every launch_rows rows of a window past
    #: the first (a window of R rows adds layers x (ceil(R / launch_rows) - 1) x this), fitted
    #: to measured windows wider than launch_rows (scripts/sim_expert_cache_study.py
    #: --fit-launch).
    per_layer_launch_s: float = 0.0
    #: bytes model: the LM head's rows (the vocabulary), which every draft pass reads: with
    #: engine.draft_vocab=K a pass reads K of them (the draft head), so the window's other bytes
    #: drop by (head_rows - K) x head_row_bytes per pass. 0: not given (a bytes model cannot
    #: then price engine.draft_vocab).
    head_rows: int = 0
    #: bytes model: the bytes of one LM head row (hidden size x the head's bytes per weight);
    #: 0: not given.
    head_row_bytes: float = 0.0
    #: bytes model: what a byte of the FP8 draft head (engine.draft_head=fp8) costs in bf16
    #: head bytes' time: the streamed FP8 linear over the head's many rows reads below the rate
    #: the bf16 head's GEMM does (1: the same rate).
    fp8_head_byte_cost: float = 1.0
    #: bytes model: a prompt chunk's time over its windows' bytes model (a chunk of T tokens
    #: prices as a 1-group window of T rows times this): what the window fit leaves out of
    #: prefill (MoE calls of 32 rows each reading their experts, the chunked delta rule),
    #: fitted to the engine's measured cohorts (scripts/sim_expert_cache_study.py --fit).
    prefill_scale: float = 1.0
    #: bytes model: the same factor for a prompt chunk's expert bytes alone (null: prefill_scale),
    #: where prefill_scale then prices the rest (the fixed per-layer part and the other bytes).
    #: A chunk of several launches (engine.prefill_slots, long prompts) repeats the expert part
    #: only, so the two are told apart by chunks of one launch and of several.
    prefill_expert_scale: Optional[float] = None
    #: bytes model: seconds per computed row of a prompt chunk (its slots' chunks, each padded
    #: to the chunk's bucket), on top of the two scaled parts: the prompt work that grows with
    #: the chunk's rows (or slots: the measured chunks cannot tell them apart), which the two
    #: parts alone priced as expert bytes. 0 keeps the two-part model.
    prefill_row_s: float = 0.0
    #: Either cost model: fixed seconds per read of a missed expert on top of its bytes over
    #: memory.bus_gb_s.
    miss_s: float = 2e-6


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
    experts: SimExpertsConfig = field(default_factory=SimExpertsConfig)
    hardware: SimHardwareConfig = field(default_factory=SimHardwareConfig)


def register_configs() -> None:
    store_schemas(SimConfig, "sim_schema", group_prefix="sim_")
    if not OmegaConf.has_resolver("sim_conf"):
        # `${sim_conf:profiles/X.json}`: a path under conf/sim/, as hardware presets name
        # their profile wherever the simulator runs from.
        OmegaConf.register_new_resolver("sim_conf", lambda rel: str(Path(SIM_CONF_DIR) / rel))


def compose_sim(overrides: list[str]) -> Any:
    """The simulator's config as `python -m sim` composes it from conf/sim with `overrides`
    (for scripts and studies that run many predictions in one process)."""
    from hydra import compose, initialize_config_dir

    register_configs()
    with initialize_config_dir(config_dir=SIM_CONF_DIR, version_base="1.3"):
        return compose(config_name="config", overrides=list(overrides))


class SimConfigError(ConfigError):
    """A simulator configuration value that cannot run (names the key and the problem)."""


def validate_engine(e: Any) -> None:
    """strata's engine validator, then the simulator's own knobs."""
    validate_strata_engine(e, SimConfigError)
    if e.graph_policy not in GRAPH_POLICIES:
        raise SimConfigError(f"engine.graph_policy: must be one of {GRAPH_POLICIES}, got {e.graph_policy!r}")
    if e.batch_mtp and e.drafting and e.mode == "batch" and e.window_rows < 2:
        raise SimConfigError(f"engine.window_rows: batch_mtp needs 2-row groups, "
                             f"engine.window_rows={e.window_rows}")


def validate_memory(m: Any) -> None:
    def bad(key: str, msg: str) -> None:
        raise SimConfigError(f"memory.{key}: {msg}")

    for key in MEMORY_FACTS:
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
    validate_workload_base(w, SimConfigError)
    if w.burst_size < 1:
        bad("burst_size", f"must be >= 1, got {w.burst_size}")
    for lo, hi in (("prompt_tokens", "prompt_tokens_max"), ("max_tokens", "max_tokens_max"),
                   ("burst_size", "burst_size_max")):
        if getattr(w, hi) is not None and getattr(w, hi) < getattr(w, lo):
            bad(hi, f"{getattr(w, hi)} is below {lo}={getattr(w, lo)}")
    if w.kind == "poisson" and w.rate_per_s <= 0:
        bad("rate_per_s", f"must be > 0, got {w.rate_per_s}")
    if w.burst_gap_s < 0 or w.burst_spread_s < 0:
        bad("burst_gap_s", "burst_gap_s and burst_spread_s must be >= 0")
    if not 0.0 <= w.filtered_share <= 1.0:
        bad("filtered_share", f"must be in [0, 1], got {w.filtered_share}")
    if w.request_seeds is not None and not 0 <= w.request_seeds < 2**62:
        bad("request_seeds", f"must be null or in [0, 2**62), got {w.request_seeds}")


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
    if a.pin_requests and (a.model != "chain" or not a.from_trace):
        raise SimConfigError("acceptance.pin_requests: needs acceptance=chain and "
                             "acceptance.from_trace=FILE (the traced requests' difficulties)")


def validate_spread(s: Any) -> None:
    q = list(s.quantiles)
    if len(q) != 2 or not 0.0 <= q[0] <= q[1] <= 1.0:
        raise SimConfigError(f"spread.quantiles: must be two ascending numbers in [0, 1], got {q}")
    if not 0.0 <= s.machine < 1.0:
        raise SimConfigError(f"spread.machine: must be in [0, 1), got {s.machine}")


def validate_experts(x: Any, engine: Any, memory: Any) -> None:
    def bad(key: str, msg: str) -> None:
        raise SimConfigError(f"experts.{key}: {msg}")

    if x.experts < 0:
        bad("experts", f"must be >= 0 (0 = no expert model), got {x.experts}")
    if x.cost not in EXPERT_COSTS:
        bad("cost", f"must be one of {EXPERT_COSTS}, got {x.cost!r}")
    if x.experts == 0:
        if engine.expert_cache_mib > 0:
            raise SimConfigError("engine.expert_cache_mib: the simulator needs the model's "
                                 "experts (experts.experts, top_k, moe_layers, expert_bytes)")
        return
    if not 1 <= x.top_k <= x.experts:
        bad("top_k", f"must be in [1, experts={x.experts}], got {x.top_k}")
    for key in ("moe_layers", "expert_bytes", "layers"):
        if getattr(x, key) < 1:
            bad(key, f"must be >= 1, got {getattr(x, key)}")
    for key in ("skew", "miss_s", "per_layer_s", "other_base_bytes", "other_per_group_bytes",
                "other_per_draft_bytes", "swap_limit", "head_rows", "head_row_bytes",
                "launch_rows", "per_layer_launch_s"):
        if getattr(x, key) < 0:
            bad(key, f"must be >= 0, got {getattr(x, key)}")
    if not 0.0 <= x.row_overlap <= 1.0:
        bad("row_overlap", f"must be in [0, 1], got {x.row_overlap}")
    if not 0.0 < x.decay <= 1.0:
        bad("decay", f"must be in (0, 1], got {x.decay}")
    if not x.fp8_head_byte_cost > 0.0:
        bad("fp8_head_byte_cost", f"must be > 0, got {x.fp8_head_byte_cost}")
    if not 0.0 < x.hbm_efficiency <= 1.0:
        bad("hbm_efficiency", f"must be in (0, 1], got {x.hbm_efficiency}")
    if not x.prefill_scale > 0.0:
        bad("prefill_scale", f"must be > 0, got {x.prefill_scale}")
    if x.prefill_expert_scale is not None and not x.prefill_expert_scale > 0.0:
        bad("prefill_expert_scale", f"must be null or > 0, got {x.prefill_expert_scale}")
    if not x.prefill_row_s >= 0.0:
        bad("prefill_row_s", f"must be >= 0, got {x.prefill_row_s}")
    if memory.hbm_gb_s <= 0:
        raise SimConfigError("memory.hbm_gb_s: the expert model needs the card's memory "
                             "bandwidth (GB/s), got 0")
    if engine.expert_cache_mib > 0 and memory.bus_gb_s <= 0:
        raise SimConfigError("memory.bus_gb_s: the expert cache needs the host -> device "
                             "bandwidth (GB/s), got 0")


def validate(cfg: Any) -> None:
    if cfg.mode not in MODES:
        raise SimConfigError(f"mode: must be one of {MODES}, got {cfg.mode!r}")
    if cfg.mode == "replay" and not cfg.trace:
        raise SimConfigError("trace: mode=replay needs trace=FILE (an engine trace.jsonl)")
    if cfg.max_steps < 1:
        raise SimConfigError(f"max_steps: must be >= 1, got {cfg.max_steps}")
    if cfg.seed < 0:
        raise SimConfigError(f"seed: must be >= 0, got {cfg.seed}")
    validate_engine(cfg.engine)
    validate_memory(cfg.memory)
    validate_workload(cfg.workload)
    ctx = cfg.engine.max_context
    if cfg.mode == "predict" and cfg.workload.prompt_tokens >= ctx:
        # The engine refuses such a request (strata/engine/request.py); simulated, every one
        # would "finish" after one token and the prediction would count it. (A range that only
        # reaches past the context is a warning: sim.predict.build_scenario.)
        raise SimConfigError(f"workload.prompt_tokens: {cfg.workload.prompt_tokens} leaves no "
                             f"room in engine.max_context={ctx} (a prompt takes at most "
                             f"{ctx - 1})")
    validate_acceptance(cfg.acceptance)
    validate_spread(cfg.spread)
    validate_experts(cfg.experts, cfg.engine, cfg.memory)
