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
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional, Sequence

import torch

from strata.config import ConfigError


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


def draft_head(model, ecfg, eos: Sequence[int]):
    """(ids, head) of the draft vocabulary engine.draft_vocab asks for: its ascending token ids
    and the LM head's rows for them, both on the model's device; (None, None) when drafts read
    the whole LM head."""
    ids = draft_vocab_ids(ecfg, model.args.vocab_size, eos)
    if ids is None:
        return None, None
    head = model.lm_head_rows(ids)
    return ids.to(head.device), head
