"""Bad checkpoints (the checkpoint audit): each case here loaded silently, loaded wrong numbers
or crashed with a raw traceback before its fix. Every one is now one CheckpointError naming the
file and the tensor or key (`python -m strata` and scripts/quantize_fp8.py: one `error:` line,
exit code 2). config.json's own checks are tests/test_checkpoint.py's.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import checkpoint_error, edit_tensors
from strata.model.config import CheckpointError
from strata.model.fp8 import FP8_DTYPE
from strata.model.loader import load_checkpoint
from strata.model.quantize import quantize_checkpoint
from test_checkpoint import _shard
from test_cli_audit import assert_one_error, strata_cli

pytestmark = pytest.mark.usefixtures("single_thread")
QUIET = dict(log=lambda _m: None)
REPO = Path(__file__).resolve().parent.parent
INDEX = "model.safetensors.index.json"
#: An expert weight and a dense projection, FP8 in the quantised checkpoint.
EXPERT = "model.layers.1.mlp.experts.2.down_proj.weight"
DENSE = "model.layers.3.self_attn.o_proj.weight"


@pytest.fixture(scope="module")
def fp8_ckpt(tiny_ckpt, tmp_path_factory) -> Path:
    """The base checkpoint in FP8, blocks of (16, 12) (read-only)."""
    return quantize_checkpoint(tiny_ckpt, tmp_path_factory.mktemp("fp8") / "ckpt", (16, 12), **QUIET)


@pytest.fixture
def fp8_copy(fp8_ckpt, tmp_path) -> Path:
    return Path(shutil.copytree(fp8_ckpt, tmp_path / "fp8"))


@torch.no_grad()
def _logits(path: Path, **kw) -> torch.Tensor:
    lm = load_checkpoint(path, dtype="float32", **QUIET, **kw)
    toks = torch.arange(12).view(1, 12) % lm.args.vocab_size
    return lm.model.logits(lm.model.forward_train(toks))


def _write_index(path: Path, weight_map: dict) -> None:
    (path / INDEX).write_text(json.dumps({"weight_map": weight_map}))


def _weight_map(path: Path) -> dict:
    return json.loads((path / INDEX).read_text())["weight_map"]


# ---- shards and their index ------------------------------------------------------------------
def test_index_that_is_not_utf8(ckpt_copy):
    _shard(ckpt_copy)
    (ckpt_copy / INDEX).write_bytes(b"\xff\xfe{")
    checkpoint_error(ckpt_copy, ckpt_copy / INDEX, "malformed", "UnicodeDecodeError")


@pytest.mark.parametrize("where", ["other shard", "no shard"])
def test_index_maps_a_tensor_to_a_shard_that_lacks_it(ckpt_copy, where):
    """A stale index (or a shard of another checkpoint) used to load without a word."""
    second = _shard(ckpt_copy)
    wm = _weight_map(ckpt_copy)
    if where == "other shard":
        key = next(k for k, v in wm.items() if v != second.name)
        wm[key] = second.name
        needle = "(it is in model-00001-of-00002.safetensors)"
    else:
        key = "model.layers.0.mlp.gate.bias"
        wm[key] = second.name
        needle = "(no shard has it)"
    _write_index(ckpt_copy, wm)
    checkpoint_error(ckpt_copy, ckpt_copy / INDEX, repr(key), f"to {second.name}", needle)


@pytest.mark.parametrize("name", ["", "../outside.safetensors", 3])
def test_index_must_name_shard_files_of_the_directory(ckpt_copy, name):
    """"" named the directory itself ("missing shard"), "../x" loaded a file from elsewhere
    (and scripts/quantize_fp8.py would write there), an int crashed with a raw TypeError."""
    second = _shard(ckpt_copy)
    shutil.copy(second, ckpt_copy.parent / "outside.safetensors")
    wm = {k: name for k in _weight_map(ckpt_copy)} if name == 3 else \
        {k: name if v == second.name else v for k, v in _weight_map(ckpt_copy).items()}
    _write_index(ckpt_copy, wm)
    checkpoint_error(ckpt_copy, ckpt_copy / INDEX, "weight_map must name shard files", repr(name))


def test_two_shards_defining_the_same_tensor(ckpt_copy):
    """The shard sorted last used to win silently (here: a zeroed copy of the head)."""
    second = _shard(ckpt_copy)
    first = ckpt_copy / "model-00001-of-00002.safetensors"
    key = next(iter(load_file(str(first))))
    sd = load_file(str(second))
    sd[key] = torch.zeros_like(load_file(str(first))[key])
    save_file(sd, str(second))
    checkpoint_error(ckpt_copy, second, repr(key), "also in model-00001-of-00002.safetensors")


def test_two_keys_filling_the_same_expert(ckpt_copy):
    """experts.01 and experts.1 are both expert 1: whichever came last was loaded."""
    key = "model.layers.0.mlp.experts.1.gate_proj.weight"
    alias = key.replace("experts.1.", "experts.01.")
    edit_tensors(ckpt_copy, lambda sd: sd.__setitem__(alias, torch.zeros_like(sd[key])))
    checkpoint_error(ckpt_copy, ckpt_copy / "model.safetensors", repr(alias), repr(key),
                     "expert 1, gate")


# ---- dtypes ----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,name", [(torch.int8, "I8"), (torch.int32, "I32"),
                                        (torch.bool, "BOOL"), (torch.float64, "F64")])
def test_tensor_of_an_unsupported_dtype(ckpt_copy, dtype, name):
    """Integer and bool tensors were cast to float (wrong numbers, no word); float64 is no
    dtype of a qwen3_next checkpoint: a conversion mistake."""
    edit_tensors(ckpt_copy, lambda sd: sd.__setitem__(EXPERT, sd[EXPERT].to(dtype)))
    checkpoint_error(ckpt_copy, ckpt_copy / "model.safetensors", repr(EXPERT), name, "F32, BF16, F16")


# ---- FP8 block scales ------------------------------------------------------------------------
def _nan(s):
    s.view(-1)[0] = float("nan")


def _inf(s):
    s.fill_(float("inf"))


def _negative(s):
    s.view(-1)[-1] *= -1


@pytest.mark.parametrize("fp8", ["dequant", "keep"])
@pytest.mark.parametrize("key", [EXPERT, DENSE])
@pytest.mark.parametrize("damage", [_nan, _inf, _negative], ids=["nan", "inf", "negative"])
def test_scale_that_is_not_finite_or_negative(fp8_copy, key, fp8, damage):
    """A NaN scale used to load and give NaN logits (or none, where no token routes to the
    expert); a negative one silently flipped its block's sign."""
    edit_tensors(fp8_copy, lambda sd: damage(sd[key + "_scale_inv"]))
    checkpoint_error(fp8_copy, fp8_copy / "model.safetensors", repr(key + "_scale_inv"),
                     "NaN, infinite or negative", fp8=fp8, fp8_dense="fp8")


def test_zero_scale_is_an_all_zero_block(fp8_copy):
    """0 is what amax / 448 gives an all-zero block (some quantisers write it): accepted."""
    edit_tensors(fp8_copy, lambda sd: sd[DENSE + "_scale_inv"].zero_())
    assert torch.isfinite(_logits(fp8_copy)).all()


@pytest.mark.parametrize("dtype,name", [(torch.int32, "I32"), (torch.bool, "BOOL"),
                                        (torch.float64, "F64")])
def test_scale_of_a_non_float_dtype(fp8_copy, dtype, name):
    edit_tensors(fp8_copy, lambda sd: sd.__setitem__(DENSE + "_scale_inv",
                                                     sd[DENSE + "_scale_inv"].to(dtype)))
    checkpoint_error(fp8_copy, fp8_copy / "model.safetensors", repr(DENSE + "_scale_inv"), name,
                     "block scales must be")


def test_fp8_weight_that_is_not_2d(fp8_copy):
    """A 1-D FP8 tensor crashed in scale_shape with a raw ValueError."""
    key = "model.norm.weight"
    def edit(sd):
        sd[key] = sd[key].to(FP8_DTYPE)
        sd[key + "_scale_inv"] = torch.ones(4)
    edit_tensors(fp8_copy, edit)
    checkpoint_error(fp8_copy, fp8_copy / "model.safetensors", repr(key), "(64,)", "2-D")


def test_activation_scheme_must_be_dynamic(fp8_copy):
    cfg = json.loads((fp8_copy / "config.json").read_text())
    cfg["quantization_config"]["activation_scheme"] = "static"
    (fp8_copy / "config.json").write_text(json.dumps(cfg))
    checkpoint_error(fp8_copy, fp8_copy / "config.json", "activation_scheme", "'static'")


def test_block_larger_than_every_weight(tiny_ckpt, tmp_path):
    """A block at least as large as a weight is one block: weight_block_size [2**40, 2**40]
    is the same checkpoint as [4096, 4096]. Both the quantiser and the loader padded or
    expanded to the block first, asking for terabytes (a raw allocation error)."""
    huge = quantize_checkpoint(tiny_ckpt, tmp_path / "huge", (1 << 40, 1 << 40), **QUIET)
    big = quantize_checkpoint(tiny_ckpt, tmp_path / "big", (4096, 4096), **QUIET)
    a, b = load_file(str(huge / "model.safetensors")), load_file(str(big / "model.safetensors"))
    bits = lambda t: t.view(torch.uint8) if t.dtype == FP8_DTYPE else t  # noqa: E731
    assert a.keys() == b.keys() and all(torch.equal(bits(a[k]), bits(b[k])) for k in a)
    assert torch.equal(_logits(huge), _logits(big))
    keep = dict(fp8="keep", fp8_dense="fp8")
    assert torch.equal(_logits(huge, **keep), _logits(big, **keep))


# ---- generation_config.json's end-of-text ids ------------------------------------------------
@pytest.mark.parametrize("text,needle", [
    ('{"eos_token_id": "x"}', "got ['x']"),
    ('{"eos_token_id": [0, 99999]}', "got [99999]"),
    ('{"eos_token_id": true}', "got [True]"),
])
def test_generation_config_eos_out_of_range(ckpt_copy, text, needle):
    """The engine stops on these ids and the server hands them out: a string or an id past
    the vocabulary used to load and silently never end a completion."""
    cfg = json.loads((ckpt_copy / "config.json").read_text())
    del cfg["eos_token_id"]  # so that the tokenizer's ids are the model's
    (ckpt_copy / "config.json").write_text(json.dumps(cfg))
    (ckpt_copy / "generation_config.json").write_text(text)
    checkpoint_error(ckpt_copy, ckpt_copy / "generation_config.json", "eos_token_id", "[0, 512)", needle)


def test_generation_config_that_is_not_utf8(ckpt_copy):
    (ckpt_copy / "generation_config.json").write_bytes(b"\xff\xfe")
    checkpoint_error(ckpt_copy, ckpt_copy / "generation_config.json", "not UTF-8")


# ---- scripts/quantize_fp8.py -----------------------------------------------------------------
def test_quantize_into_its_own_source_is_refused(ckpt_copy):
    """DST = SRC overwrote the source's model.safetensors and config.json, then crashed."""
    before = {f.name: f.read_bytes() for f in ckpt_copy.iterdir()}
    for dst in (ckpt_copy, ckpt_copy / "."):
        with pytest.raises(CheckpointError, match="is the source checkpoint"):
            quantize_checkpoint(ckpt_copy, dst, (16, 12), **QUIET)
    assert {f.name: f.read_bytes() for f in ckpt_copy.iterdir()} == before


def test_quantize_into_a_used_destination_is_refused(tiny_ckpt, tmp_path):
    """A non-empty DST was written over, its old shards and index left to mix with the new
    checkpoint; a file as DST crashed with FileExistsError. An empty directory is fine."""
    used = tmp_path / "used"
    used.mkdir()
    (used / "model-00001-of-00002.safetensors").write_bytes(b"old")
    (tmp_path / "file").write_text("x")
    for dst in (used, tmp_path / "file"):
        with pytest.raises(CheckpointError, match="exists and is not an empty directory"):
            quantize_checkpoint(tiny_ckpt, dst, (16, 12), **QUIET)
    assert [f.name for f in used.iterdir()] == ["model-00001-of-00002.safetensors"]
    (tmp_path / "empty").mkdir()
    quantize_checkpoint(tiny_ckpt, tmp_path / "empty", (16, 12), **QUIET)


def test_quantize_checks_the_source_tensors(ckpt_copy, fp8_ckpt, tmp_path):
    """A corrupt source shard was a raw SafetensorError; an int8 tensor was copied through;
    FP8 tensors under a config.json without quantization_config were quantised again."""
    f = ckpt_copy / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:100])
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        quantize_checkpoint(ckpt_copy, tmp_path / "a", (16, 12), **QUIET)
    f.write_bytes(data)
    edit_tensors(ckpt_copy, lambda sd: sd.__setitem__(EXPERT, sd[EXPERT].to(torch.int8)))
    with pytest.raises(CheckpointError, match="dtype I8"):
        quantize_checkpoint(ckpt_copy, tmp_path / "b", (16, 12), **QUIET)
    plain = Path(shutil.copytree(fp8_ckpt, tmp_path / "plain"))
    cfg = json.loads((plain / "config.json").read_text())
    del cfg["quantization_config"]
    (plain / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="float8_e4m3fn but .* no quantization_config"):
        quantize_checkpoint(plain, tmp_path / "c", (16, 12), **QUIET)
    assert not any((tmp_path / d).exists() for d in "abc")


def _quantize_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "scripts/quantize_fp8.py", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_quantize_script_bad_arguments_are_one_error_line(tiny_ckpt, fp8_ckpt, tmp_path):
    src = Path(shutil.copytree(tiny_ckpt, tmp_path / "src"))
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "x").write_text("x")
    for args, needles in [
        ([str(tmp_path / "nope"), str(tmp_path / "o1")], ["config.json", "missing"]),
        ([str(src), str(src)], ["is the source checkpoint"]),
        ([str(src), str(tmp_path / "used")], ["exists and is not an empty directory"]),
        ([str(src), str(tmp_path / "o2"), "--block", "0", "12"], ["--block", "[0, 12]"]),
        ([str(fp8_ckpt), str(tmp_path / "o3")], ["already has a quantization_config"]),
    ]:
        assert_one_error(_quantize_cli(*args), *needles)
    assert not any((tmp_path / f"o{i}").exists() for i in (1, 2, 3))
    assert "quantization_config" not in json.loads((src / "config.json").read_text())


# ---- python -m strata ------------------------------------------------------------------------
@pytest.mark.slow
def test_cli_bad_checkpoints_are_one_error_line(ckpt_copy, fp8_copy, tmp_path):
    edit_tensors(ckpt_copy, lambda sd: sd.__setitem__(EXPERT, sd[EXPERT].to(torch.int8)))
    edit_tensors(fp8_copy, lambda sd: _nan(sd[DENSE + "_scale_inv"]))
    for path, needles in [(ckpt_copy, [repr(EXPERT), "I8"]),
                          (fp8_copy, [repr(DENSE + "_scale_inv"), "NaN"])]:
        p = strata_cli(f"model.path={path}", f"hydra.run.dir={tmp_path / 'run'}")
        assert_one_error(p, *needles)
