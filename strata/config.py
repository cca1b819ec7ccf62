"""Structured-config schemas for every knob strata has.

Each dataclass is registered in Hydra's ConfigStore as the schema of its config group, so an
override with an unknown key or a wrong type is an error that names the key, never a silent
default. The YAML files under conf/ only choose values; the fields and their types live here.
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass, field, fields, is_dataclass
from pathlib import Path
from typing import Any, Iterator, Optional

from hydra.core.config_store import ConfigStore

#: The tiny Qwen3-Next + MTP checkpoint shipped inside the package (the default model).
EMBEDDED_MODEL_DIR = str(Path(__file__).resolve().parent / "assets" / "tiny-qwen3-next")


@dataclass
class ModelConfig:
    #: A Hugging Face checkpoint directory (config.json, safetensors, tokenizer.json).
    path: str = EMBEDDED_MODEL_DIR
    #: auto (the checkpoint's torch_dtype, float32 on CPU), float32, bfloat16 or float16.
    dtype: str = "auto"
    #: MoE blocks with at most this many experts always run dense as two fused matmuls (fewer
    #: launches, and the same arithmetic for every window shape); larger ones (and FP8 ones) run
    #: the routed experts grouped by expert (ops.moe_experts) whenever rows x top-k is below the
    #: expert count, with the shared expert folded into the same call where it has their shape.
    moe_dense_experts: int = 16
    #: Prompt chunks of unquantised many-expert blocks (rows x top-k >= the expert count) run
    #: every expert as dense matmuls instead of grouping rows by expert: faster prefill at large
    #: chunks, but other rounding than the grouped path that decode windows and the expert
    #: cache take, so with it on a run with engine.expert_cache_mib > 0 is not bit-identical to
    #: one without. Off: one expert path at every size (FP8 experts always group). Decode
    #: windows never take it; it needs engine.prefill_slots=1 (the chunk's rows decide it).
    moe_dense_prefill: bool = False
    #: auto: the safetensors weights (a directory without them is an error that says to pass
    #: dummy); safetensors: the same; dummy: seeded random weights built on the device from
    #: config.json alone (benchmarks at real shapes without a checkpoint).
    load_format: str = "auto"
    #: load_format=dummy: the seed of the random weights (the same seed, the same weights).
    dummy_seed: int = 0
    #: load_format=dummy: run only the first N decoder layers (null = the config's
    #: num_hidden_layers), e.g. a bfloat16 80B model at the depth that fits.
    num_layers: Optional[int] = None
    #: FP8 checkpoints on a GPU: fp8 (the dense, non-expert linear layers stay FP8 and run on
    #: ops.linear_fp8), dequant (they get a bf16 copy at load and run on cuBLAS), windows
    #: (where the streamed FP8 tensor-core kernel runs, CUDA sm_90+, they stay FP8 for decode
    #: windows and prompt chunks run each on a copy dequantised in the chunk, one matmul where
    #: the FP8 kernel reads the weight once per 16 rows; DeltaNet's float b/a projection is
    #: computed in the conv's launch; elsewhere dequant) or auto (as windows for the
    #: contracting projections such as o_proj and out_proj only, the wide input projections
    #: dequantised at load). Routed and shared experts stay FP8.
    fp8_dense: str = "windows"
    #: load_format=dummy: skew of the dummy routers' expert popularity (SYNTHETIC, for expert
    #: cache studies). 0 = the uniform popularity of random routers; s > 0 biases expert e's
    #: router logit so its popularity falls off like a Zipf law of exponent s (trained routers
    #: are skewed; docs/EXPERT_CACHE.md gives the embedded model's measured popularity).
    dummy_routing_skew: float = 0.0


#: Field metadata of an engine knob that every engine trace's `config` line has recorded since
#: the trace format began, so a replay refuses a trace without it (knobs added later are
#: optional there: a trace without one ran the schema's default).
TRACED = {"traced_since_v1": True}


@dataclass
class EngineConfig:
    #: solo: one request at a time; batch: up to `slots` requests share windows.
    mode: str = field(default="batch", metadata=TRACED)
    #: Grouped MTP verification in batch slots; STRATA_BATCH_MTP=0|1 replaces this default, and
    #: an explicit engine.batch_mtp=... on the command line beats the environment.
    batch_mtp: bool = field(default=True, metadata=TRACED)
    #: Drafts a batch_mtp slot verifies per window at most: 1, the one draft of the upstream
    #: feature; k > 1 (up to spec - 1) or null (spec - 1): as many as the window has room for,
    #: window_rows // decoding slots rows each (never fewer than 2), so that a few slots fill
    #: a window with deeper groups instead of leaving its rows unused.
    batch_mtp_drafts: Optional[int] = 1
    #: Decoding lanes asked for; the engine runs what fits in memory and says so.
    slots: int = field(default=4, metadata=TRACED)
    #: Verify rows per solo step (1 = no speculation); also a lone batch slot's window.
    spec: int = field(default=4, metadata=TRACED)
    #: Rows of one verifier forward (W).
    window_rows: int = field(default=8, metadata=TRACED)
    #: Share of iterations that are decode windows while prefill and decode both wait.
    decode_share: float = field(default=0.5, metadata=TRACED)
    #: Prompt tokens per prefill iteration.
    prefill_chunk: int = field(default=256, metadata=TRACED)
    #: Prefilling slots one prompt chunk may hold (null, auto: 8 on one device; 1 with
    #: engine.stages > 1, engine.batch_invariant, model.moe_dense_prefill or the expert cache),
    #: each its next `prefill_chunk` tokens padded to the bucket of the longest, so that a burst
    #: of prompts reads the weights once per chunk rather than once per prompt.
    prefill_slots: Optional[int] = None
    #: Lengths a prompt chunk is padded to (ascending), so prefill runs a few static shapes that
    #: are captured as graphs once; a chunk longer than the last runs unpadded and eagerly.
    prefill_buckets: list[int] = field(default_factory=lambda: [16, 32, 64, 128, 256])
    #: Replay prompt chunks from captured graphs too (on CUDA, when `graphs` is on).
    prefill_graphs: bool = True
    #: Context length of a slot (positions 0 .. max_context-1).
    max_context: int = field(default=4096, metadata=TRACED)
    #: Smallest context tier; tiers double from here up to max_context.
    context_tier_min: int = field(default=256, metadata=TRACED)
    #: Groups-per-window buckets of the `shape` graph key (ascending).
    shape_buckets: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16], metadata=TRACED)
    #: Run windows by replaying captured graphs (CUDA graphs on GPU, recorded plans on CPU).
    graphs: bool = field(default=True, metadata=TRACED)
    #: Graph-cache key: `shape` (bucket + tier) or `layout` (exact layout + tier).
    graph_key: str = field(default="shape", metadata=TRACED)
    #: Every window runs exactly `window_rows` rows (padding groups on the scratch lane, each
    #: group's rows rounded up to a divisor of window_rows), so the verify forward's
    #: projection, MoE and head matmuls have one shape in every mode (bfloat16 picks kernels by
    #: shape), and its attention splits keys in fixed chunks (invariant_split_keys), for the
    #: cost of computing the padding rows. docs/ENGINE.md says what it does not fix.
    batch_invariant: bool = False
    #: Under batch_invariant: the verify attention's split-K chunk in keys (rounded up to 64),
    #: the same at every context tier and group count, so a row's attention sums in one order.
    invariant_split_keys: int = 256
    #: Most graphs kept (LRU); 0 = unbounded.
    graph_limit: int = field(default=32, metadata=TRACED)
    #: Device memory kept free, never planned for (MiB).
    vram_reserve_mib: int = field(default=2048, metadata=TRACED)
    #: Planned size of a graph before any capture was measured (MiB).
    graph_mib_estimate: float = field(default=16.0, metadata=TRACED)
    #: CPU capture backend: size charged for each recorded plan (MiB), CPU has no graphs.
    cpu_graph_mib: float = 16.0
    #: CPU capture backend: the device size the memory budget is computed against (MiB).
    cpu_device_mib: int = 24576
    #: Emit a `vram` trace event every this many iterations (0 = never).
    vram_every: int = 64
    #: torch.compile the pure regions of a window step: auto (on CUDA), on, off.
    compile: str = "auto"
    #: Compiled regions give a group or row count of 1 graphs of their own (torch.compile's
    #: 0/1 specialisation; true), or compile one graph for every count (false: fewer graphs
    #: to compile, so a shorter warm-up, and the 1-row kernels generic). Process-wide.
    compile_specialize_one: bool = True
    #: Processes that compile the warm-up's graphs beside it (each over a copy of the model cut
    #: to one layer of each kind, dummy weights, on the same device), leaving them in
    #: torch.compile's on-disk caches for the warm-up to load: null = auto (the default: on
    #: CUDA one per 4 cores, 2 to 4, as free device memory allows; none on the CPU, with
    #: engine.stages > 1 or with the expert cache, where a number is an error), N = N, 0 = off.
    #: The text is a cold compile's either way (docs/ENGINE.md "Compile workers").
    compile_workers: Optional[int] = None
    #: Run every window and prompt-chunk shape once on the scratch lane at start, so compiling
    #: happens before the first request, not during it: auto (when compiling), on, off.
    warmup: str = "auto"
    #: After the warm-up, move every object then alive (the model, the compiled regions, the
    #: graphs) to the garbage collector's permanent generation (gc.freeze), so that its full
    #: passes during serving skip them: a full pass over them took 0.5-0.7 s on a GPU host, a
    #: stall of every request in flight. Process-wide; Engine.close() thaws them.
    gc_freeze: bool = True
    #: Benchmarks on dummy weights: null verifies drafts; p in [0, 1] accepts each draft with
    #: probability p given that the drafts before it were (keyed by request seed and position,
    #: so every mode takes the same decisions). The output text is then not the model's.
    synthetic_acceptance: Optional[float] = None
    #: Drafts choose among this many tokens (0 = the whole vocabulary): the draft head reads only
    #: their rows of the LM head, which at a 151,936-token vocabulary is most of a draft step's
    #: bytes (strata/engine/draft_vocab.py). Verification still samples over every token, so
    #: the text is unchanged; acceptance drops where a target lies outside them. The tokens:
    #: engine.draft_vocab_file's first ids, else the lowest ids; the end-of-text ids always.
    draft_vocab: int = 0
    #: engine.draft_vocab: a JSON list of token ids, most frequent first
    #: (scripts/draft_vocab.py counts them over a corpus); null = the lowest ids.
    draft_vocab_file: Optional[str] = None
    #: What drafts read their logits from: model (the model's LM head, or engine.draft_vocab's
    #: copy of its rows, in the model's dtype) or fp8 (an FP8 block-scaled copy of those rows,
    #: 128 x 128 blocks, made at start: half a bf16 head's bytes a draft step). Verification
    #: still samples over the model's own head, so the text is unchanged; a draft differs only
    #: where FP8 reorders near-tied logits (strata/engine/draft_vocab.py).
    draft_head: str = "model"
    #: Device memory for routed experts (MiB); 0 = every routed expert resident on the device.
    #: When set, routed experts live in pinned host memory and a per-layer set of device slots
    #: holds the cached ones within this budget; a miss is read from host memory inside the
    #: window (strata/engine/expert_cache.py).
    expert_cache_mib: int = 0
    #: Expert cache: every this many decode windows, swap the least-routed resident experts for
    #: the most-routed missing ones (decayed counts), copying on a side stream; 0 = never.
    expert_adapt_every: int = 8
    #: Expert cache: a routing profile (scripts/profile_routing.py's JSON, per-layer expert
    #: counts) that chooses the first resident set; null = the lowest expert ids first.
    expert_profile: Optional[str] = None
    #: Plan and launch window t+1 while the device runs window t (the host hidden behind the
    #: device; acceptance-dependent inputs are written on the device by the commit): null
    #: (auto) = on with engine.stages=1 (with or without the expert cache), off with stages;
    #: true; false.
    overlap: Optional[bool] = None
    #: Pipeline stages: consecutive layer ranges on this many devices, one process each
    #: (torch.distributed: NCCL on CUDA, gloo on CPU); the last holds the head and MTP layer.
    stages: int = 1
    #: stages > 1: auto (balance bytes per stage) or the decoder layers per stage, comma
    #: separated, summing to the model's depth (e.g. "20,28").
    stage_layers: str = "auto"
    #: stages > 1: split the decoding slots into `stages` groups, round-robin, and keep one
    #: window per group in flight (stage 1 runs one group's window while the last verifies
    #: another's; drafts travel with their group).
    pipeline_groups: bool = False
    #: stages > 1: each stage replays graphs of its own window compute, the messages between
    #: stages outside them: null (auto) = on for CPU stages (recorded plans), off on CUDA until
    #: the two-GPU tests have run them (tests/test_stages_gpu.py -k graphs); true; false.
    stage_graphs: Optional[bool] = None


#: Every engine knob, in declaration order: what an engine trace's `config` line records.
ENGINE_KNOBS = tuple(f.name for f in fields(EngineConfig))
#: The knobs every engine trace has recorded (a replay refuses a trace without one).
TRACED_ENGINE_KNOBS = tuple(f.name for f in fields(EngineConfig) if f.metadata.get("traced_since_v1"))
def engine_knobs(e: Any) -> dict[str, Any]:
    """Every engine knob's value as plain data (lists, not ListConfig), by name."""
    return {k: (list(v) if isinstance(v := getattr(e, k), (list, tuple)) else v)
            for k in ENGINE_KNOBS}


ENGINE_MODES = ("solo", "batch")
GRAPH_KEYS = ("shape", "layout")
SWITCHES = ("auto", "on", "off")
#: engine.draft_head's values
DRAFT_HEADS = ("model", "fp8")


@dataclass
class BackendConfig:
    #: Kernel implementation: auto (the built cyext kernels for the device, else torch),
    #: torch (reference), cpu (C++), cuda, hip.
    name: str = "auto"


@dataclass
class WorkloadBaseConfig:
    """The workload knobs the engine's WorkloadConfig and the simulator's SimWorkloadConfig
    share (how many requests, how long, when they arrive), declared once; each extends it
    with its own kinds of workload. A conf/ YAML sets what differs from these defaults."""

    #: Number of requests (the engine's kind=file: one per line of the file instead).
    requests: int = 4
    #: Prompt length in tokens (the engine's: of kind=synthetic's random-id prompts).
    prompt_tokens: int = 64
    #: Tokens to generate per request, unless a request line gives its own.
    max_tokens: int = 48
    #: Arrival step of request i is i * stagger_steps.
    stagger_steps: int = 0
    #: 0: every request arrives when the workload says (its step or time). k >= 1: a closed
    #: loop of k clients: the first k requests arrive so, and each one that finishes is
    #: followed by the next in the following iteration, so at most k are in flight.
    concurrency: int = 0


@dataclass
class WorkloadConfig(WorkloadBaseConfig):
    #: default (4 code prompts), file (JSON Lines at `path`) or synthetic.
    kind: str = "default"
    #: kind=file: the JSON Lines request file (one request object per line; README).
    path: Optional[str] = None
    #: Sampling temperature (0 = greedy), unless a request line gives its own.
    temperature: float = 0.0
    #: Nucleus sampling mass in (0, 1] (1 = off), unless a request line gives its own.
    top_p: float = 1.0
    #: Keep the k most likely tokens (0 = off), unless a request line gives its own.
    top_k: int = 0
    #: Sampling seed (and kind=synthetic's prompt ids); request i of kind=default or synthetic
    #: uses seed + i.
    seed: int = 0


@dataclass
class ServerConfig:
    #: Address to listen on.
    host: str = "127.0.0.1"
    #: Port to listen on (0 = any free port).
    port: int = 8000
    #: Bearer token required on /v1/* when set. Prefer $STRATA_API_KEY or api_key_file: a key
    #: given here on the command line is saved as REDACTED in the run dir's .hydra/ files.
    api_key: Optional[str] = None
    #: A file whose first line is the API key (not saved anywhere by strata).
    api_key_file: Optional[str] = None
    #: Tokens generated for a chat or completion request that gives no max_tokens (clipped to
    #: the room left in the context).
    default_max_tokens: int = 256
    #: Name reported by /v1/models (defaults to the checkpoint directory's name).
    model_name: Optional[str] = None
    #: Seconds to wait before restarting a dead engine child, and Retry-After meanwhile.
    restart_delay_s: float = 1.0
    #: Longest a request may wait in the engine's queue before it is failed (s).
    queue_timeout_s: float = 600.0
    #: Most requests accepted and not finished at once; more get 429.
    max_pending: int = 256
    #: A ready engine that sends nothing (not even its 4-per-second heartbeat) for this long is
    #: hung: it is killed, its requests fail with an error, and it restarts. 0 = never.
    #: Generous by default: a first compile of a new window shape can take tens of seconds.
    step_timeout_s: float = 300.0
    #: Server log level: critical, error, warning, info, debug or trace.
    log_level: str = "info"


@dataclass
class StrataConfig:
    #: auto (cuda when present, else cpu), cpu or cuda.
    device: str = "auto"
    #: Print per-request outputs and the metrics table.
    print_outputs: bool = True
    #: Show a progress bar while the workload runs.
    progress: bool = True
    model: ModelConfig = field(default_factory=ModelConfig)
    engine: EngineConfig = field(default_factory=EngineConfig)
    backend: BackendConfig = field(default_factory=BackendConfig)
    workload: WorkloadConfig = field(default_factory=WorkloadConfig)
    server: ServerConfig = field(default_factory=ServerConfig)


class ConfigError(ValueError):
    """A configuration value that cannot run (names the key and the problem)."""


def store_schemas(root: type, root_name: str, group_prefix: str = "") -> None:
    """Register `root` as the primary config's schema and each of its dataclass fields as the
    schema of the config group of that name (`<group_prefix><group>_schema`)."""
    cs = ConfigStore.instance()
    cs.store(name=root_name, node=root)
    for f in fields(root):
        if callable(f.default_factory) and is_dataclass(node := f.default_factory()):
            cs.store(group=f.name, name=f"{group_prefix}{f.name}_schema", node=type(node))


def register_configs() -> None:
    store_schemas(StrataConfig, "strata_schema")


def _schema_fields(schema: type) -> dict[str, Optional[type]]:
    """A dataclass schema's field names, each with its nested schema (None for a leaf)."""
    import typing

    hints = typing.get_type_hints(schema)
    return {f.name: hints[f.name] if is_dataclass(hints[f.name]) else None for f in fields(schema)}


def unknown_key_message(path: str, key: str, known: Any) -> str:
    """`path+key: unknown key`, with the closest known key when one is close (a typo)."""
    import difflib

    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    if close:
        return f"{path}{key}: unknown key; did you mean {path}{close[0]}?"
    return f"{path}{key}: unknown key (known: {', '.join(sorted(known))})"


def check_key(dotted: str, root: Optional[type] = None) -> None:
    """Refuse a dotted key (`engine.slots`) that no schema declares, suggesting the closest;
    `root`: the config's schema (StrataConfig; the simulator passes its own)."""
    schema: Optional[type] = root or StrataConfig
    path = ""
    for part in dotted.split("."):
        if schema is None:  # below a leaf (a list index, say): the config decides
            return
        known = _schema_fields(schema)
        if part not in known:
            raise ConfigError(unknown_key_message(path, part, known))
        schema, path = known[part], f"{path}{part}."


def check_known_keys(cfg: Any, root: Optional[type] = None) -> None:
    """Refuse keys no schema declares (Hydra's `+group.key=...` can add them past the schema);
    `root`: the config's schema (StrataConfig; the simulator passes its own)."""
    from omegaconf import DictConfig

    def walk(node: Any, schema: type, path: str) -> None:
        known = _schema_fields(schema)
        for key in node.keys():
            if key not in known:
                raise ConfigError(unknown_key_message(path, key, known))
            child = node[key] if isinstance(node, DictConfig) else None
            if isinstance(child, DictConfig) and known[key] is not None:
                walk(child, known[key], f"{path}{key}.")

    walk(cfg, root or StrataConfig, "")


def batch_mtp_from_env(cfg_value: bool, explicit: bool = False) -> bool:
    """The batch_mtp to run. `STRATA_BATCH_MTP=1|0` replaces the configured default; a value
    given explicitly (`engine.batch_mtp=...` on the command line: explicit=True) beats it."""
    env = os.environ.get("STRATA_BATCH_MTP")
    if env is not None and env not in ("", "0", "1"):
        raise ConfigError(f"STRATA_BATCH_MTP must be 0 or 1, got {env!r}")
    if explicit or not env:
        return bool(cfg_value)
    return env == "1"


@contextlib.contextmanager
def environ_set(name: str, value: str) -> Iterator[None]:
    """$name set to `value` for the duration, then restored (or unset, if it was)."""
    old = os.environ.get(name)
    os.environ[name] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = old


def validate_engine(e: Any, error: type[ValueError] = ConfigError) -> None:
    """Check engine knobs that a schema cannot express; raise `error` naming the key. The
    engine, the server and the simulator (whose engine schema extends EngineConfig) all call
    this one validator, so they accept exactly the same values."""
    def bad(key: str, msg: str) -> None:
        raise error(f"engine.{key}: {msg}")

    for key, allowed in (("mode", ENGINE_MODES), ("compile", SWITCHES), ("warmup", SWITCHES),
                         ("graph_key", GRAPH_KEYS)):
        if getattr(e, key) not in allowed:
            bad(key, f"must be {', '.join(allowed[:-1])} or {allowed[-1]}, got {getattr(e, key)!r}")
    p = e.synthetic_acceptance
    if p is not None and not (isinstance(p, (int, float)) and 0.0 <= p <= 1.0):
        bad("synthetic_acceptance", f"must be null or in [0, 1], got {p!r}")
    if e.slots < 1:
        bad("slots", f"must be >= 1, got {e.slots}")
    if e.window_rows < 1:
        bad("window_rows", f"must be >= 1, got {e.window_rows}")
    if e.spec < 1:
        bad("spec", f"must be >= 1, got {e.spec}")
    if e.invariant_split_keys < 1:
        bad("invariant_split_keys", f"must be >= 1, got {e.invariant_split_keys}")
    if e.spec > e.window_rows:
        bad("spec", f"engine.spec={e.spec} exceeds engine.window_rows={e.window_rows}")
    d = e.batch_mtp_drafts
    if d is not None and d < 1:
        bad("batch_mtp_drafts", f"must be >= 1 or null (spec - 1), got {d}")
    if d is not None and d > 1 and d > e.spec - 1:
        bad("batch_mtp_drafts", f"engine.batch_mtp_drafts={d} exceeds engine.spec - 1 = "
                                f"{e.spec - 1} (a group verifies at most engine.spec rows)")
    if not 0.0 < e.decode_share <= 1.0:
        bad("decode_share", f"must be in (0, 1], got {e.decode_share}")
    if e.prefill_chunk < 1:
        bad("prefill_chunk", f"must be >= 1, got {e.prefill_chunk}")
    if e.prefill_slots is not None and e.prefill_slots < 1:
        bad("prefill_slots", f"must be >= 1 or null (auto), got {e.prefill_slots}")
    if not e.prefill_buckets or list(e.prefill_buckets) != sorted(set(e.prefill_buckets)) \
            or e.prefill_buckets[0] < 1:
        bad("prefill_buckets", f"must be ascending distinct positive ints, got {list(e.prefill_buckets)}")
    if e.graph_limit < 0:
        bad("graph_limit", f"must be >= 0 (0 = unbounded), got {e.graph_limit}")
    if e.vram_reserve_mib < 0:
        bad("vram_reserve_mib", f"must be >= 0, got {e.vram_reserve_mib}")
    for key in ("graph_mib_estimate", "cpu_graph_mib", "cpu_device_mib", "vram_every"):
        if getattr(e, key) < 0:
            bad(key, f"must be >= 0, got {getattr(e, key)}")
    for key in ("graph_mib_estimate", "cpu_graph_mib"):  # nan passes `< 0`; inf breaks the plan
        if not math.isfinite(getattr(e, key)):
            bad(key, f"must be a finite number >= 0, got {getattr(e, key)}")
    if e.max_context < 2:
        bad("max_context", f"must be >= 2, got {e.max_context}")
    if e.context_tier_min < 1:
        bad("context_tier_min", f"must be >= 1, got {e.context_tier_min}")
    if not e.shape_buckets or list(e.shape_buckets) != sorted(set(e.shape_buckets)) or e.shape_buckets[0] < 1:
        bad("shape_buckets", f"must be ascending distinct positive ints, got {list(e.shape_buckets)}")
    for key in ("expert_cache_mib", "expert_adapt_every"):
        if getattr(e, key) < 0:
            bad(key, f"must be >= 0, got {getattr(e, key)}")
    if e.stages < 1:
        bad("stages", f"must be >= 1, got {e.stages}")
    if e.draft_vocab < 0:
        bad("draft_vocab", f"must be >= 0 (0 = the whole vocabulary), got {e.draft_vocab}")
    if e.draft_vocab_file is not None and e.draft_vocab == 0:
        bad("draft_vocab_file", "ranks the tokens of a draft vocabulary: set engine.draft_vocab "
                                "to its size too")
    if e.draft_vocab and e.stages > 1:
        bad("draft_vocab", f"the draft head is built on one device; engine.stages={e.stages} "
                           f"needs engine.draft_vocab=0")
    if e.draft_head not in DRAFT_HEADS:
        bad("draft_head", f"must be one of {', '.join(DRAFT_HEADS)}, got {e.draft_head!r}")
    if e.draft_head != "model" and e.stages > 1:
        bad("draft_head", f"the draft head is built on one device; engine.stages={e.stages} "
                          f"needs engine.draft_head=model")
    w = e.compile_workers
    if w is not None and w < 0:
        bad("compile_workers", f"must be >= 0 or null (auto), got {w}")
    if w and e.stages > 1:
        bad("compile_workers", f"engine.stages={e.stages} compiles in its stage processes: "
                               f"use engine.compile_workers=0 or null with it")
    if w and e.expert_cache_mib > 0:
        bad("compile_workers", "the expert cache's graphs depend on the whole model's cache "
                               "layout: use engine.compile_workers=0 or null with "
                               "engine.expert_cache_mib > 0")
    if e.stages > 1 and (e.prefill_slots or 1) > 1:
        bad("prefill_slots", f"prompt chunks of several slots run on one device; "
                             f"engine.stages={e.stages} needs engine.prefill_slots=1")
    if e.batch_invariant and (e.prefill_slots or 1) > 1:
        bad("prefill_slots", f"engine.batch_invariant=true fixes every matmul's row count; "
                             f"prompt chunks of several slots change theirs: it needs "
                             f"engine.prefill_slots=1, got {e.prefill_slots}")
    if e.stages > 1 and e.expert_cache_mib:
        bad("expert_cache_mib", f"the expert cache runs on one device; engine.stages={e.stages} "
                                f"needs engine.expert_cache_mib=0")
    if e.overlap and e.stages > 1:
        bad("overlap", f"engine.overlap=true runs on one device; with engine.stages={e.stages} "
                       f"engine.pipeline_groups keeps windows in flight instead: set "
                       f"engine.overlap=null (auto: off with stages) or false, or engine.stages=1")
    if e.stage_graphs and (e.stages < 2 or not e.graphs):
        bad("stage_graphs", f"captures each stage's window compute: needs engine.stages >= 2 and "
                            f"engine.graphs=true, got engine.stages={e.stages}, "
                            f"engine.graphs={str(e.graphs).lower()}")
    if e.pipeline_groups and e.stages < 2:
        bad("pipeline_groups", f"pipelines slot groups across stages: needs engine.stages >= 2, "
                               f"got engine.stages={e.stages}")
    if e.stage_layers != "auto":
        try:
            counts = [int(c) for c in str(e.stage_layers).split(",")]
        except ValueError:
            counts = []
        if len(counts) != e.stages or min(counts) < 1:
            bad("stage_layers", f"must be auto or {e.stages} positive layer counts separated by "
                                f"commas (one per stage), got {e.stage_layers!r}")


def stage_graphs_on(e: Any, device_type: str) -> bool:
    """Whether a split's stages replay graphs of their window compute: as set, or when null
    (auto) on CPU stages only (CUDA captures next to NCCL have not run on two GPUs yet)."""
    if not e.graphs:
        return False
    if e.stage_graphs is not None:
        return bool(e.stage_graphs)
    return device_type != "cuda"


#: engine.prefill_slots=null on one device: a burst of up to eight prompts in one chunk. On the
#: H200 eight slots a chunk gave +25% at batch_mtp W16 N=8 on the 80B FP8 shapes (946 against
#: 757 tok/s) and +26% on the tiny model (36,688 against 29,049), and the simulator a better
#: TTFT at p50 and p95 for such a burst.
AUTO_PREFILL_SLOTS = 8


def prefill_slots_of(e: Any, dense_prefill: bool = False) -> int:
    """engine.prefill_slots as the engine runs it: as set, or when null (auto)
    AUTO_PREFILL_SLOTS, except 1 where a chunk must hold one slot (engine.stages > 1,
    engine.batch_invariant, or `dense_prefill`: model.moe_dense_prefill's blocks) and with the
    expert cache, whose prompt launches stay 32 rows and whose studies ran one slot a chunk."""
    if e.prefill_slots is not None:
        return int(e.prefill_slots)
    if int(e.stages) > 1 or e.batch_invariant or dense_prefill or e.expert_cache_mib:
        return 1
    return AUTO_PREFILL_SLOTS


def overlap_on(e: Any) -> bool:
    """Whether engine.overlap runs: as set, or when null (auto) on exactly when the engine runs
    on one device (engine.stages=1), with or without the expert cache. A cache that misses and
    swaps runs overlapped too: on the H200 it was faster than the serial loop in three of the
    four cells timed and within the spread between engines in the fourth (the device busier in
    each, the same windows), and the simulator models and replays its swaps."""
    if e.overlap is not None:
        return bool(e.overlap)
    return int(e.stages) == 1


def validate_workload_base(w: Any, error: type[ValueError] = ConfigError, *,
                           made_up: bool = True) -> None:
    """Check the workload knobs the engine and the simulator share (WorkloadBaseConfig); raise
    `error` naming the key. made_up=False: the requests come from a file (the engine's
    kind=file), whose lines say their own prompts, so `requests` and `prompt_tokens` are unused."""
    for key in ("requests", "prompt_tokens", "max_tokens") if made_up else ("max_tokens",):
        if getattr(w, key) < 1:
            raise error(f"workload.{key}: must be >= 1, got {getattr(w, key)}")
    if w.stagger_steps < 0:
        raise error(f"workload.stagger_steps: must be >= 0, got {w.stagger_steps}")
    if w.concurrency < 0:
        raise error(f"workload.concurrency: must be >= 0 (0 = no closed loop), got {w.concurrency}")


def validate_model(m: Any) -> None:
    """Check model knobs before the checkpoint is read (the loader checks the rest: the path,
    load_format and num_layers against the checkpoint)."""
    if m.moe_dense_experts < 0:
        raise ConfigError(f"model.moe_dense_experts: must be >= 0, got {m.moe_dense_experts}")
    if not 0 <= m.dummy_routing_skew < math.inf:  # nan or inf: NaN router logits, no text
        raise ConfigError(f"model.dummy_routing_skew: must be a finite number >= 0, "
                          f"got {m.dummy_routing_skew}")
    if not str(m.path).strip():  # Path("") is the working directory
        raise ConfigError(f"model.path: must name a checkpoint directory, got {m.path!r}")


def plain_engine_config(ecfg: Any) -> EngineConfig:
    """An EngineConfig dataclass from an OmegaConf node (or a dataclass), validated by type."""
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if isinstance(ecfg, EngineConfig):
        return ecfg
    if isinstance(ecfg, DictConfig):
        try:
            node = OmegaConf.merge(OmegaConf.structured(EngineConfig), ecfg)
        except OmegaConfBaseException as e:
            raise ConfigError(f"engine config: {e}".splitlines()[0]) from None
        return OmegaConf.to_object(node)
    raise TypeError(f"engine config must be an EngineConfig or a DictConfig, got {type(ecfg).__name__}")
