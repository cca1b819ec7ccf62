"""Load and save Hugging Face format checkpoints (config.json, safetensors, tokenizer.json)."""

from __future__ import annotations

import json
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Optional

import torch
import torch.nn as nn
from safetensors import safe_open
from safetensors.torch import save_file

from strata.kernels.reference import dequant_fp8_block
from strata.model.config import CheckpointError, ModelArgs, check_eos_ids, load_model_args
from strata.model.dummy import apply_routing_skew, init_dummy
from strata.model.fp8 import (FP8_DTYPE, contracting, dense_to_dequantize, dequantize_dense,
                              dequantize_in_prompts, QuantConfig,
                              fp8_supported, load_quant_config, scale_shape, to_fp8_linear)
from strata.model.placement import (LoadProgress, check_weights_fit, count_weight_bytes,
                                    device_available_bytes, host_available_bytes,
                                    host_routed_params, materialize)
from strata.model.qwen3_next import Experts, Qwen3Next, Rotary
from strata.model.stage_slice import StageSlice, global_view, stage_args
from strata.model.tokenizer import Tokenizer
from strata.model.weight_map import QWEN3_NEXT, KeyMap

#: model.fp8_dense: what an FP8 checkpoint's dense (non-expert) linear layers become on a GPU.
FP8_DENSE = ("auto", "dequant", "fp8", "windows")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
LOAD_FORMATS = ("auto", "safetensors", "dummy")
#: Config directories shipped with the package (model presets name them).
ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets"
FP8_SAFETENSORS = "F8_E4M3"  # safetensors' name for float8_e4m3fn
#: safetensors' names of the float dtypes a checkpoint's other tensors may have (DTYPES').
FLOAT_SAFETENSORS = ("F32", "BF16", "F16")


@dataclass
class LoadedModel:
    model: Qwen3Next
    args: ModelArgs
    tokenizer: Optional[Tokenizer]
    path: Path
    has_mtp: bool
    dtype: torch.dtype
    #: The checkpoint's FP8 quantization_config (None: a float checkpoint).
    quant: Optional[QuantConfig] = None
    #: FP8 weights kept in FP8 (dequantised inside the kernels) rather than at load.
    fp8: bool = False
    #: load_checkpoint's arguments (but the device, the log, the stage and the key map):
    #: compile workers build the same model at another depth from them
    #: (strata/engine/compile_workers.py). Empty: not built by load_checkpoint.
    load_args: dict = field(default_factory=dict)


def resolve_dtype(name: str, args: ModelArgs, device: torch.device) -> torch.dtype:
    """`auto`: the checkpoint's dtype on GPU, float32 on CPU (CPU half-precision matmul is slow)."""
    if name == "auto":
        if device.type == "cpu":
            return torch.float32
        return DTYPES.get(args.torch_dtype, torch.bfloat16)
    if name not in DTYPES:
        raise CheckpointError(f"model.dtype: {name!r} is not one of auto, {', '.join(DTYPES)}")
    return DTYPES[name]


def _shard_files(path: Path) -> tuple[list[Path], dict[str, Path]]:
    """The weight files, and for a sharded checkpoint the index's tensor -> shard map."""
    single = path / "model.safetensors"
    index = path / "model.safetensors.index.json"
    if single.is_file():
        return [single], {}
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            files = sorted(set(weight_map.values()))
        # (UnicodeDecodeError and JSONDecodeError are ValueErrors)
        except (ValueError, RecursionError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index}: malformed shard index ({type(e).__name__}: {e})") from None
        for f in files:
            # a plain file name: "" would be the directory itself, "../x" a file elsewhere
            # (scripts/quantize_fp8.py writes each shard under its name)
            if not isinstance(f, str) or f in ("", ".", "..") or Path(f).name != f:
                key = next(k for k, v in weight_map.items() if v == f)
                raise CheckpointError(f"{index}: weight_map must name shard files in {path}, "
                                      f"got {f!r} for tensor {key!r}")
            if not (path / f).is_file():
                raise CheckpointError(f"{path / f}: missing shard named in {index.name}")
        return [path / f for f in files], {k: path / v for k, v in weight_map.items()}
    raise CheckpointError(f"{path}: has no weights (no model.safetensors or "
                          f"model.safetensors.index.json); use model.load_format=dummy for "
                          f"random weights")


def resolve_model_path(path: str | Path) -> Path:
    """A checkpoint directory, or the name of a config directory shipped in strata/assets
    (the presets name them so, e.g. `qwen3-next-80b-a3b-fp8`)."""
    p = Path(path)
    if not p.is_dir() and not p.is_absolute() and (ASSETS_DIR / p).is_dir():
        return ASSETS_DIR / p
    return p


def truncate_layers(args: ModelArgs, num_layers: int) -> ModelArgs:
    """The first `num_layers` decoder layers of the config (model.num_layers)."""
    if not 1 <= num_layers <= args.num_hidden_layers:
        raise CheckpointError(f"model.num_layers: must be in [1, {args.num_hidden_layers}] "
                              f"(the config's num_hidden_layers), got {num_layers}")
    return replace(args, num_hidden_layers=num_layers, layer_types=args.layer_types[:num_layers],
                   mlp_only_layers=[i for i in args.mlp_only_layers if i < num_layers])


@dataclass
class _Entry:
    """A tensor of the checkpoint, from the safetensors headers."""
    file: Path
    dtype: str  # safetensors dtype name: F32, BF16, F8_E4M3, ...
    shape: tuple[int, ...]


def _scan(files: list[Path]) -> dict[str, _Entry]:
    out: dict[str, _Entry] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as sf:
                found = {}
                for k in sf.keys():
                    sl = sf.get_slice(k)
                    found[k] = (sl.get_dtype(), tuple(sl.get_shape()))
        except Exception as e:  # safetensors raises its own SafetensorError (or OSError)
            raise CheckpointError(f"{f}: not a readable safetensors file ({e})") from None
        for k, (dtype, shape) in found.items():
            if k in out:  # which copy would win is an accident of file order
                raise CheckpointError(f"{f}: tensor {k!r} is also in {out[k].file.name} (two "
                                      f"shards define it)")
            out[k] = _Entry(f, dtype, shape)
    return out


def read_entries(path: Path) -> dict[str, _Entry]:
    """Every tensor of a checkpoint directory's weight files, from their headers, each in one
    file only and, for a sharded checkpoint, in the shard its index names."""
    files, weight_map = _shard_files(path)
    entries = _scan(files)
    for key, shard in weight_map.items():
        e = entries.get(key)
        if e is None or e.file != shard:  # a stale index or a shard of another checkpoint
            where = f"it is in {e.file.name}" if e is not None else "no shard has it"
            raise CheckpointError(f"{path / 'model.safetensors.index.json'}: maps tensor {key!r} "
                                  f"to {shard.name}, which does not hold it ({where})")
    return entries


def check_entries(entries: dict[str, _Entry], quant: Optional[QuantConfig], path: Path) -> set[str]:
    """The FP8 weight keys, each checked against its scale and the quantization_config; every
    other tensor must be of a float dtype (the loader casts those to the model's dtype)."""
    fp8 = set()
    for key, e in entries.items():
        if e.dtype.startswith("F8") and e.dtype != FP8_SAFETENSORS:
            raise CheckpointError(f"{e.file}: tensor {key!r} has dtype {e.dtype}: FP8 weights "
                                  f"must be float8_e4m3fn ({FP8_SAFETENSORS})")
        if e.dtype != FP8_SAFETENSORS:
            # an integer or bool tensor cast to float would load as wrong numbers; no
            # qwen3_next checkpoint stores float64, so it is a conversion mistake too
            if e.dtype not in FLOAT_SAFETENSORS:
                raise CheckpointError(f"{e.file}: tensor {key!r} has dtype {e.dtype}, not one "
                                      f"strata loads ({', '.join(FLOAT_SAFETENSORS)}, or "
                                      f"{FP8_SAFETENSORS} for FP8 weights)")
            continue
        if quant is None:
            raise CheckpointError(f"{e.file}: tensor {key!r} is float8_e4m3fn but "
                                  f"{path / 'config.json'} has no quantization_config")
        if not key.endswith(".weight"):
            raise CheckpointError(f"{e.file}: tensor {key!r} is FP8, but only weights can be")
        if not quant.converts(key[: -len(".weight")]):
            raise CheckpointError(f"{e.file}: tensor {key!r} is FP8 but its module is in "
                                  f"quantization_config.modules_to_not_convert")
        if len(e.shape) != 2:  # HF's format quantises linear layers (and each expert's) only
            raise CheckpointError(f"{e.file}: FP8 tensor {key!r} has shape {e.shape}: FP8 "
                                  f"weights must be 2-D (a linear layer's or one expert's)")
        skey = key + "_scale_inv"
        s = entries.get(skey)
        if s is None:
            raise CheckpointError(f"{e.file}: FP8 tensor {key!r} has no block scales {skey!r}")
        if s.dtype not in FLOAT_SAFETENSORS:
            raise CheckpointError(f"{s.file}: tensor {skey!r} has dtype {s.dtype}: block scales "
                                  f"must be {', '.join(FLOAT_SAFETENSORS)}")
        want = scale_shape(e.shape, quant.block)
        if s.shape != want:
            raise CheckpointError(f"{s.file}: tensor {skey!r} has shape {s.shape}, expected {want} "
                                  f"(weight {e.shape}, weight_block_size {list(quant.block)})")
        fp8.add(key)
    for key, e in entries.items():
        if key.endswith(".weight_scale_inv") and key[: -len("_scale_inv")] not in fp8:
            raise CheckpointError(f"{e.file}: unexpected tensor {key!r} (a scale without an FP8 "
                                  f"weight)")
    return fp8


def _to_fp8_modules(model: Qwen3Next, params: set[str], block: tuple[int, int]) -> None:
    """Turn the modules whose weights are `params` (FP8 in the checkpoint) into FP8 modules."""
    done = set()
    for name in sorted(params):
        mod_name, leaf = name.rsplit(".", 1)
        parent = model.get_submodule(mod_name)
        if isinstance(parent, Experts):
            other = f"{mod_name}.{'w_down' if leaf == 'w_gate_up' else 'w_gate_up'}"
            if other not in params:
                raise CheckpointError(f"{mod_name}: {leaf} is FP8 but {other.rsplit('.', 1)[1]} "
                                      f"is not (both expert weights must share a format)")
            if mod_name not in done:
                parent.to_fp8(block)
                done.add(mod_name)
            continue
        owner_name, attr = mod_name.rsplit(".", 1) if "." in mod_name else ("", mod_name)
        owner = model.get_submodule(owner_name) if owner_name else model
        if leaf != "weight" or not isinstance(parent, nn.Linear):
            raise CheckpointError(f"{name}: only linear layers and experts can hold FP8 weights")
        to_fp8_linear(owner, attr, block)


def _slice(dest: torch.Tensor, target) -> torch.Tensor:
    """The part of a parameter one checkpoint tensor fills (experts: one expert's gate, up
    or down, or their scales)."""
    if target.expert is None:
        return dest
    if target.expert >= dest.shape[0]:
        raise IndexError
    half = dest.shape[1] // 2
    if target.part == "gate":
        return dest[target.expert, :half]
    if target.part == "up":
        return dest[target.expert, half:]
    return dest[target.expert]


def load_model(mcfg, device: str | torch.device, log=print,
               stage: Optional[StageSlice] = None, routed_on_host: bool = False) -> LoadedModel:
    """The model a `model` config group names (strata.config.ModelConfig: path, dtype and the
    loading knobs); `stage`: only a pipeline stage's part of it (strata/model/stage_slice.py);
    `routed_on_host`: the expert cache is on (load_checkpoint)."""
    return load_checkpoint(mcfg.path, mcfg.dtype, device, log=log,
                           moe_dense_experts=int(mcfg.moe_dense_experts),
                           moe_dense_prefill=bool(mcfg.moe_dense_prefill),
                           load_format=mcfg.load_format, dummy_seed=int(mcfg.dummy_seed),
                           num_layers=mcfg.num_layers, fp8_dense=mcfg.fp8_dense,
                           routing_skew=float(mcfg.dummy_routing_skew), stage=stage,
                           routed_on_host=routed_on_host)


def load_checkpoint(path: str | Path, dtype: str = "auto", device: str | torch.device = "cpu",
                    keymap: KeyMap = QWEN3_NEXT, log=print, fuse: bool = True,
                    moe_dense_experts: int = 16, moe_dense_prefill: bool = False,
                    load_format: str = "auto", dummy_seed: int = 0,
                    num_layers: Optional[int] = None, fp8: str = "auto",
                    fp8_dense: str = "windows", routing_skew: float = 0.0,
                    stage: Optional[StageSlice] = None,
                    routed_on_host: bool = False) -> LoadedModel:
    """Build the model from a checkpoint directory; every problem names the file and the key.

    load_format: safetensors (the weights), dummy (seeded random weights from config.json
    alone, made on `device`), auto (safetensors). num_layers: run only the first N decoder
    layers (dummy only). fp8: what FP8 block checkpoints become: auto (FP8 on a GPU that has
    it, else dequantised exactly), keep, or dequant (tests use keep to run the FP8 path on CPU).
    fp8_dense: where FP8 is kept, whether the dense (non-expert) linear layers stay FP8 (`fp8`)
    or are dequantised to the model dtype at load (`dequant`); `auto` keeps the contracting
    projections (o_proj, out_proj, the MTP fc) FP8 where the streamed FP8 linear runs (CUDA,
    sm_90+), for decode windows (prompt chunks dequantise them: fp8.project), and dequantises
    the rest, and everything elsewhere; `windows` keeps every dense FP8 layer so there
    (prompt chunks dequantise each), and dequantises elsewhere (model.fp8_dense).
    routing_skew: dummy only, model.dummy_routing_skew (synthetic skewed expert popularity).
    stage: build only this pipeline stage's layers (and the embedding, head and MTP it holds);
    the result's args are the stage's (StageSlice), its has_mtp the checkpoint's.
    routed_on_host: on a GPU, hold the decoder's routed experts in host memory, never on the
    device (the expert cache, engine.expert_cache_mib > 0, then takes its device slots from
    them; strata/model/placement.py). Weights that cannot fit where they go are a ConfigError
    before anything is allocated.
    """
    path = resolve_model_path(path)
    if load_format not in LOAD_FORMATS:
        raise CheckpointError(f"model.load_format: {load_format!r} is not one of {', '.join(LOAD_FORMATS)}")
    if fp8 not in ("auto", "keep", "dequant"):
        raise CheckpointError(f"fp8: {fp8!r} is not one of auto, keep, dequant")
    if fp8_dense not in FP8_DENSE:
        raise CheckpointError(f"model.fp8_dense: {fp8_dense!r} is not one of {', '.join(FP8_DENSE)}")
    if not path.is_dir():
        raise CheckpointError(f"model.path: {path} is not a directory")
    if load_format == "dummy" and not (path / "config.json").is_file():
        raise CheckpointError(f"model.load_format=dummy: {path / 'config.json'} is missing (dummy "
                              f"weights are built from a config.json)")
    device = torch.device(device)
    args = load_model_args(path)
    quant = load_quant_config(path)
    if routing_skew and load_format != "dummy":
        raise CheckpointError("model.dummy_routing_skew: only with model.load_format=dummy (a "
                              "checkpoint's routers are its own)")
    if num_layers is not None:
        if load_format != "dummy":
            raise CheckpointError("model.num_layers: only with model.load_format=dummy (a "
                                  "checkpoint's weights are loaded for all its layers)")
        args = truncate_layers(args, int(num_layers))
    if stage is not None:
        args = stage_args(args, stage)
    tdtype = resolve_dtype(dtype, args, device)
    keep_fp8 = quant is not None and (fp8 == "keep" or (fp8 == "auto" and fp8_supported(device)))
    if quant is not None and not keep_fp8 and fp8 == "auto" and device.type == "cuda":
        cap = ".".join(map(str, torch.cuda.get_device_capability(device)))
        log(f"INFO: this GPU (compute capability {cap} < 8.9) has no FP8: dequantising the FP8 "
            f"weights to {str(tdtype).replace('torch.', '')} at load")
    entries: dict[str, _Entry] = {}
    fp8_keys: set[str] = set()
    if load_format == "dummy":
        with_mtp = args.num_nextn_predict_layers > 0
    else:
        entries = read_entries(path)
        fp8_keys = check_entries(entries, quant, path)
        with_mtp = any(k.startswith("mtp.") for k in entries)
    with torch.device("meta"):
        model = Qwen3Next(args, with_mtp=with_mtp and (stage is None or stage.last)).to(tdtype)
    # What is materialised, filled and loaded, under the whole model's parameter names.
    part = model if stage is None else global_view(model, stage)
    if stage is not None:
        entries = _stage_entries(entries, part, keymap)
        fp8_keys &= set(entries)
    if keep_fp8:
        if load_format == "dummy":
            fp8_params = _dummy_fp8_params(part, quant, keymap)
        else:
            fp8_params = set()
            for k in fp8_keys:
                t = keymap.to_target(k)
                if t is None:
                    raise CheckpointError(f"{entries[k].file}: unexpected tensor {k!r} (no such parameter)")
                fp8_params.add(t.param)
        _to_fp8_modules(part, fp8_params, quant.block)
    keep_dense = None  # the dense FP8 layers that stay FP8 (model.fp8_dense)
    if keep_fp8 and fp8_dense in ("auto", "windows"):
        from strata.kernels.cyext_ops import linear_fp8_streams
        if linear_fp8_streams(device):
            keep_dense = contracting if fp8_dense == "auto" else (lambda name, mod: True)
    host = (host_routed_params(part, moe_dense_experts)
            if routed_on_host and device.type == "cuda" and stage is None else [])
    dequantized = ([m for _, m in dense_to_dequantize(part, keep_dense)]
                   if keep_fp8 and fp8_dense != "fp8" else [])
    need = count_weight_bytes(part, tdtype, dequantized, host)
    check_weights_fit(path.name, need, device, device_available_bytes(device),
                      host_available_bytes())
    progress = LoadProgress(need.device + need.host, log)
    if host:
        log(f"INFO: the routed experts of {len(host) // 2} MoE layers are held in host memory "
            f"(engine.expert_cache_mib: the cache takes its device slots from them)")
    materialize(part, device, host)
    if args.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    if load_format == "dummy":
        init_dummy(part, dummy_seed, device, progress)
        if routing_skew:
            apply_routing_skew(part, routing_skew, dummy_seed)
            log(f"INFO: model.dummy_routing_skew={routing_skew}: the dummy routers' expert "
                f"popularity is skewed (synthetic, Zipf-like)")
        log(f"INFO: dummy weights (seed {dummy_seed}) for {path.name}"
            + (f", first {args.num_hidden_layers} layers" if num_layers is not None else "")
            + (", FP8 block-scaled" if keep_fp8 else
               f", {str(tdtype).replace('torch.', '')} (the config is FP8; this device runs it "
               f"dequantised)" if quant is not None else ""))
    else:
        _load_tensors(part, entries, fp8_keys, keep_fp8, quant, tdtype, keymap, args, path,
                      progress)
    if keep_fp8 and fp8_dense != "fp8":
        with torch.no_grad():
            n = dequantize_dense(part, tdtype, keep_dense)
        if keep_dense:  # windows run them on the FP8 kernel, prompt chunks on a dequantised copy
            kept = dequantize_in_prompts(part)
            if not n:
                log(f"INFO: the {kept} dense FP8 layers stay FP8 on the streamed kernel in windows "
                    f"and are dequantised in each prompt chunk (model.fp8_dense={fp8_dense})")
        if n:
            log(f"INFO: {n} dense FP8 layers dequantised to {str(tdtype).replace('torch.', '')} "
                f"(model.fp8_dense={fp8_dense}"
                + ("; the contracting projections stay FP8 on the streamed kernel in windows "
                   "and are dequantised in each prompt chunk" if keep_dense else "")
                + "); the experts stay FP8")
    if stage is not None:  # a top-level module the view replaced (FP8 or dequantised) is the model's
        for name in stage.owned():
            if getattr(part, name, None) is not None:
                setattr(model, name, getattr(part, name))
    with torch.no_grad():
        # Buffers are not in the checkpoint: rebuild the rotary table on the device.
        model.rotary = Rotary(args).to(device)
    model.eval().requires_grad_(False)
    if fuse:
        model.fuse_for_inference(moe_dense_experts, moe_dense_prefill)
    if not with_mtp:
        log("INFO: checkpoint has no mtp.* weights: running without speculation")
    tok = _tokenizer(path, args.vocab_size) if (path / "tokenizer.json").is_file() else None
    if tok is not None and not args.eos_token_id:
        args.eos_token_id = tok.eos_ids
    load_args = dict(path=str(path), dtype=dtype, fuse=fuse,
                     moe_dense_experts=moe_dense_experts, moe_dense_prefill=moe_dense_prefill,
                     load_format=load_format, dummy_seed=dummy_seed, num_layers=num_layers,
                     fp8=fp8, fp8_dense=fp8_dense, routing_skew=routing_skew,
                     routed_on_host=routed_on_host) if keymap is QWEN3_NEXT else {}
    return LoadedModel(model, args, tok, path, with_mtp, tdtype, quant, keep_fp8, load_args)


def _tokenizer(path: Path, vocab_size: int) -> Tokenizer:
    """The checkpoint's tokenizer, its end-of-text ids checked as config.json's are
    (check_eos_ids)."""
    gen = path / "generation_config.json"
    try:
        tok = Tokenizer.from_dir(path)
    except UnicodeDecodeError as e:  # generation_config.json (tokenizers reads its own file)
        raise CheckpointError(f"{gen}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    check_eos_ids(tok.eos_ids, vocab_size, gen if gen.is_file() else path / "tokenizer.json")
    return tok


def _stage_entries(entries: dict[str, "_Entry"], part: nn.Module,
                   keymap: KeyMap) -> dict[str, "_Entry"]:
    """The checkpoint tensors of a stage's parameters (scales go with their weights); keys
    that map to no parameter at all stay, so that they are still reported as unexpected."""
    names = {n for n, _ in part.named_parameters(remove_duplicate=False)}
    out = {}
    for key, e in entries.items():
        base = key[: -len("_scale_inv")] if key.endswith(".weight_scale_inv") else key
        target = keymap.to_target(base)
        if target is None or target.param in names or not _is_model_param(target.param):
            out[key] = e
    return out


def _is_model_param(name: str) -> bool:
    head = name.split(".", 1)[0]
    return head in ("layers", "embed_tokens", "norm", "lm_head", "mtp")


def _dummy_fp8_params(model: Qwen3Next, quant: QuantConfig, keymap: KeyMap) -> set[str]:
    """The parameters a checkpoint of this config would store in FP8: linear weights and
    expert weights whose modules quantization_config converts."""
    out = set()
    for name, mod in model.named_modules():
        if isinstance(mod, nn.Linear):
            leafs = ["weight"]
        elif isinstance(mod, Experts):
            leafs = ["w_gate_up", "w_down"]
        else:
            continue
        for leaf in leafs:
            key = keymap.checkpoint_keys(f"{name}.{leaf}", tuple(getattr(mod, leaf).shape))[0][0]
            if quant.converts(key[: -len(".weight")]):
                out.add(f"{name}.{leaf}")
    if model.args.tie_word_embeddings:
        out.discard("lm_head.weight")
    return out


@torch.no_grad()
def _load_tensors(model: Qwen3Next, entries: dict[str, _Entry], fp8_keys: set[str], keep_fp8: bool,
                  quant: Optional[QuantConfig], tdtype: torch.dtype, keymap: KeyMap,
                  args: ModelArgs, path: Path, progress: Optional[LoadProgress] = None) -> None:
    """Copy every checkpoint tensor into its parameter (FP8 ones kept or dequantised exactly);
    `progress` is told each one's bytes."""
    params = dict(model.named_parameters(remove_duplicate=False))
    tied = {"lm_head.weight"} if args.tie_word_embeddings else set()
    covered: dict[tuple, str] = {}  # (param, expert, part) of every tensor read -> its key
    files = sorted({e.file for e in entries.values()})
    with ExitStack() as stack:
        handles = {f: stack.enter_context(safe_open(str(f), framework="pt", device="cpu"))
                   for f in files}
        for key, e in entries.items():
            if key.endswith(".weight_scale_inv"):
                continue  # read with its weight (check_entries paired them)
            target = keymap.to_target(key)
            if target is None or target.param not in params or target.param in tied:
                if key == "lm_head.weight" and tied:
                    continue
                raise CheckpointError(f"{e.file}: unexpected tensor {key!r} (no such parameter)")
            try:
                view = _slice(params[target.param], target)
            except IndexError:
                raise CheckpointError(f"{e.file}: tensor {key!r}: expert {target.expert} out of "
                                      f"range (num_experts={params[target.param].shape[0]})") from None
            if e.shape != tuple(view.shape):
                raise CheckpointError(f"{e.file}: tensor {key!r} has shape {e.shape}, "
                                      f"expected {tuple(view.shape)}")
            other = covered.get((target.param, target.expert, target.part))
            if other is not None:  # e.g. experts.01 and experts.1: one would silently win
                raise CheckpointError(f"{e.file}: tensors {other!r} and {key!r} both load into "
                                      f"{target.param}" + ("" if target.expert is None else
                                      f" (expert {target.expert}, {target.part})"))
            t = handles[e.file].get_tensor(key)
            if key in fp8_keys:
                skey = key + "_scale_inv"
                s = handles[entries[skey].file].get_tensor(skey).float()
                # a scale is its block's amax / 448: a NaN, infinite or negative one is a
                # corrupt file and would only show as NaN logits (0 is an all-zero block)
                if not (torch.isfinite(s).all() and (s >= 0).all()):
                    raise CheckpointError(f"{entries[skey].file}: tensor {skey!r} holds NaN, "
                                          f"infinite or negative block scales")
                if keep_fp8:
                    st = keymap.to_target(skey)
                    _slice(params[st.param], st).copy_(s)
                    covered[(st.param, st.expert, st.part)] = skey
                    view.copy_(t)
                else:
                    view.copy_(dequant_fp8_block(t, s, quant.block, tdtype))
            else:
                if view.dtype == FP8_DTYPE:
                    raise CheckpointError(f"{e.file}: tensor {key!r} is {t.dtype} but the other "
                                          f"experts of its layer are FP8")
                view.copy_(t.to(tdtype))
            covered[(target.param, target.expert, target.part)] = key
            if progress is not None:
                progress.add(view.numel() * view.element_size())
    missing = [key for name, p in params.items() if name not in tied
               for key, tg in keymap.checkpoint_keys(name, tuple(p.shape))
               if (tg.param, tg.expert, tg.part) not in covered]
    if missing:
        names = ", ".join(f.name for f in files)
        raise CheckpointError(f"{path}: missing tensor {missing[0]!r} (not in {names}; "
                              f"{len(missing)} missing in all)")


def save_checkpoint(model: Qwen3Next, path: str | Path, dtype: torch.dtype = torch.float32,
                    keymap: KeyMap = QWEN3_NEXT, extra_config: Optional[dict] = None) -> None:
    """Write config.json and model.safetensors with real checkpoint key names."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    args = model.args
    if any(p.dtype == FP8_DTYPE for p in model.parameters()):
        raise CheckpointError(f"{path}: save_checkpoint writes float models; FP8 checkpoints are "
                              f"written by scripts/quantize_fp8.py")
    tensors: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        if args.tie_word_embeddings and name == "lm_head.weight":
            continue
        data = p.detach().to("cpu", dtype)
        for key, target in keymap.checkpoint_keys(name, tuple(p.shape)):
            if target.expert is None:
                t = data
            elif target.part == "gate":
                t = data[target.expert, : data.shape[1] // 2]
            elif target.part == "up":
                t = data[target.expert, data.shape[1] // 2:]
            else:
                t = data[target.expert]
            tensors[key] = t.contiguous()
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    cfg = args.to_hf_dict()
    cfg["dtype"] = str(dtype).replace("torch.", "")
    cfg["num_nextn_predict_layers"] = 1 if model.mtp is not None else 0
    if extra_config:
        cfg.update(extra_config)
    (path / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")

