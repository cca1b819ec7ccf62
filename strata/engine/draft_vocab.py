"""engine.draft_vocab: the tokens drafts choose among, and the draft head that reads only them.

At a 151,936-token vocabulary the LM head (622 MB in bf16) is most of what a draft step reads:
the MTP layer's own weights and its ten experts are a few tens of MB. Drafts only propose;
verification samples every target over the whole vocabulary, so restricting the drafts to the
K most frequent tokens (FR-Spec; EAGLE-3's draft vocabulary) leaves the text as it was and
costs acceptance only where the target lies outside them, while a draft step reads K / vocab
of the head's bytes.

The tokens: the first K of `engine.draft_vocab_file` (a JSON list of token ids, most frequent
first; scripts/draft_vocab.py counts them over a text corpus), else the K lowest ids (a BPE
tokenizer numbers its merges in the order it learned them, most frequent pairs first), and the
model's end-of-text ids always, so a draft can still end a request.

engine.draft_head=fp8 halves what a draft step reads again: the draft head (those rows, or the
whole LM head without a draft vocabulary) becomes an FP8 block-scaled copy (128 x 128 blocks,
each block's amax / 448, as the FP8 checkpoints scale their weights) run on the FP8 linear.
The targets still come from the model's head, so the text is unchanged; a draft differs from
the bf16 head's only where FP8's rounding reorders near-tied logits.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

import torch
from torch import nn

from strata.config import ConfigError
from strata.engine.memory import MIB
from strata.model.fp8 import Fp8Linear


def read_ranking(path: str | Path, vocab: int) -> list[int]:
    """The token ids of a draft-vocabulary file, in its order; a ConfigError names the file and
    what is wrong with it."""
    p = Path(path)
    where = f"engine.draft_vocab_file: {p}"
    try:
        data = json.loads(p.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{where}: no such file") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"{where}: not a JSON list of token ids ({e})") from None
    if isinstance(data, dict):  # scripts/draft_vocab.py's output carries its provenance
        data = data.get("tokens")
    if not isinstance(data, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                             for t in data):
        raise ConfigError(f"{where}: must be a JSON list of token ids (or an object whose "
                          f"\"tokens\" is one)")
    bad = [t for t in data if not 0 <= t < vocab]
    if bad:
        raise ConfigError(f"{where}: token id {bad[0]} is outside the model's vocabulary "
                          f"[0, {vocab})")
    return data


def draft_tokens(size: int, vocab: int, eos: Sequence[int],
                 ranking: Optional[Sequence[int]] = None) -> list[int]:
    """The ascending ids of a draft vocabulary of `size` tokens: every end-of-text id, then the
    ranking's first distinct ids (None: 0, 1, 2, ...) until there are `size`."""
    if not 0 < size <= vocab:
        raise ConfigError(f"engine.draft_vocab: {size} is not in [1, {vocab}] (the model's "
                          f"vocabulary; 0 turns it off)")
    chosen = dict.fromkeys(t for t in eos if 0 <= t < vocab)
    if len(chosen) > size:
        raise ConfigError(f"engine.draft_vocab: {size} tokens cannot hold the model's "
                          f"{len(chosen)} end-of-text ids")
    for t in (range(vocab) if ranking is None else ranking):
        if len(chosen) == size:
            break
        chosen.setdefault(int(t), None)
    if len(chosen) < size:
        raise ConfigError(f"engine.draft_vocab: {size} tokens asked for, but the ranking "
                          f"(engine.draft_vocab_file) holds only {len(chosen)} distinct ids")
    return sorted(chosen)


def draft_vocab_ids(ecfg, vocab: int, eos: Sequence[int]) -> Optional[torch.Tensor]:
    """The draft vocabulary engine.draft_vocab / draft_vocab_file ask for, as ascending int64
    ids, or None when drafts read the whole LM head (off, or a size that is the vocabulary)."""
    size = int(ecfg.draft_vocab)
    if size <= 0:
        return None
    ranking = (read_ranking(ecfg.draft_vocab_file, vocab)
               if ecfg.draft_vocab_file is not None else None)
    ids = draft_tokens(size, vocab, eos, ranking)
    return None if len(ids) == vocab else torch.tensor(ids, dtype=torch.long)


#: engine.draft_head=fp8's block (rows x columns), the FP8 checkpoints' own
FP8_HEAD_BLOCK = (128, 128)
#: Rows quantised at a time (a multiple of the block's rows): bounds the float32 temporaries to
#: this many rows, where the whole 151,936-row head at once would take over a GB
QUANTIZE_ROWS = 16384


def fp8_head(weight: torch.Tensor) -> Fp8Linear:
    """An FP8 block-scaled copy of a float head `weight` (O, I) on its device: FP8_HEAD_BLOCK
    blocks, each scaled by its amax / 448 (strata.model.quantize.quantize_block)."""
    from strata.model.quantize import quantize_block

    o, i = weight.shape
    with torch.device(weight.device):
        head = Fp8Linear(i, o, FP8_HEAD_BLOCK)
    bo = min(FP8_HEAD_BLOCK[0], o)
    step = max(bo, QUANTIZE_ROWS // bo * bo)
    with torch.no_grad():
        for r0 in range(0, o, step):
            q, scale = quantize_block(weight[r0:r0 + step], FP8_HEAD_BLOCK)
            head.weight[r0:r0 + step] = q
            head.weight_scale_inv[r0 // bo:r0 // bo + scale.shape[0]] = scale
    return head


def head_mib(head: Optional[nn.Module]) -> float:
    """MiB a draft head's parameters hold (0 for None: the model's own head)."""
    return 0.0 if head is None else sum(p.numel() * p.element_size() for p in head.parameters()) / MIB


def draft_head(model, ecfg, eos: Sequence[int]):
    """(ids, head): the ascending token ids of the draft vocabulary engine.draft_vocab asks for
    (None: every token) and the module drafts take their logits from (None: the model's LM head
    itself), both on the model's device. The head: the LM head's rows for the ids in the
    model's dtype (nn.Linear), or with engine.draft_head=fp8 those rows, or the whole head, as
    an FP8 copy (fp8_head); an LM head that is FP8 already serves as it is."""
    ids = draft_vocab_ids(ecfg, model.args.vocab_size, eos)
    fp8 = ecfg.draft_head == "fp8"
    if ids is None and (not fp8 or isinstance(model.lm_head, Fp8Linear)):
        return None, None
    rows = model.lm_head.weight if ids is None else model.lm_head_rows(ids)
    if fp8:
        head = fp8_head(rows)
    else:
        head = nn.Linear(rows.shape[1], rows.shape[0], bias=False, device="meta")
        head.weight = nn.Parameter(rows, requires_grad=False)
    return (None if ids is None else ids.to(rows.device)), head
