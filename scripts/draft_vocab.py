"""Rank a tokenizer's tokens by how often they occur in a text corpus: engine.draft_vocab_file.

Counts every token of the corpus's files (UTF-8 text; a directory means every file under it)
with the checkpoint's tokenizer.json and writes a JSON object whose "tokens" lists every token
id of the vocabulary, the ones seen most often first (ties and unseen ids by id), with the
counts and what was read. engine.draft_vocab=K then takes the first K (and the end-of-text ids).

    python scripts/draft_vocab.py --model DIR --corpus docs/ scripts/data/code_prompts.json \\
        --out draft_vocab.json
    python -m strata engine.draft_vocab=32768 engine.draft_vocab_file=draft_vocab.json ...

Count text like the model's workload: the tokens a workload uses are the ones worth drafting.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from strata.config import EMBEDDED_MODEL_DIR  # noqa: E402
from strata.model.config import load_model_args  # noqa: E402
from strata.model.loader import resolve_model_path  # noqa: E402
from strata.model.tokenizer import Tokenizer  # noqa: E402


def corpus_files(paths: list[str]) -> list[Path]:
    """The files named, and every file under the directories named, in a stable order."""
    out = []
    for p in map(Path, paths):
        if p.is_dir():
            out += sorted(f for f in p.rglob("*") if f.is_file())
        elif p.is_file():
            out.append(p)
        else:
            raise SystemExit(f"error: --corpus: {p} is neither a file nor a directory")
    if not out:
        raise SystemExit("error: --corpus: no files")
    return out


def rank(counts: Counter, vocab: int) -> list[int]:
    """Every id in [0, vocab): the most frequent first, ties and unseen ids in id order."""
    return sorted(range(vocab), key=lambda t: (-counts.get(t, 0), t))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None,
                    help="checkpoint directory with tokenizer.json (default: the embedded model)")
    ap.add_argument("--corpus", nargs="+", required=True, help="text files or directories")
    ap.add_argument("--out", required=True, help="the JSON to write")
    a = ap.parse_args(argv)
    path = resolve_model_path(a.model or EMBEDDED_MODEL_DIR)
    if not (path / "tokenizer.json").is_file():
        raise SystemExit(f"error: --model: {path} has no tokenizer.json")
    tok = Tokenizer.from_dir(path)
    vocab = load_model_args(path).vocab_size
    counts: Counter = Counter()
    files = corpus_files(a.corpus)
    t0, skipped = time.time(), []
    for i, f in enumerate(files, 1):
        try:
            counts.update(tok.encode(f.read_text(encoding="utf-8")))
        except UnicodeDecodeError:
            skipped.append(str(f))
        if i % 200 == 0:
            print(f"{i}/{len(files)} files, {sum(counts.values()):,} tokens, "
                  f"{time.time() - t0:.0f} s", file=sys.stderr)
    if skipped:
        print(f"skipped {len(skipped)} files that are not UTF-8 text", file=sys.stderr)
    bad = [t for t in counts if not 0 <= t < vocab]
    if bad:
        raise SystemExit(f"error: the tokenizer produced id {bad[0]} outside config.json's "
                         f"vocab_size {vocab}")
    tokens = rank(counts, vocab)
    total = sum(counts.values())
    out = {"tokenizer": str(path / "tokenizer.json"), "files": len(files) - len(skipped),
           "corpus_tokens": total, "distinct_seen": len(counts), "tokens": tokens,
           "counts": [counts.get(t, 0) for t in tokens[:len(counts)]]}
    Path(a.out).write_text(json.dumps(out))
    covered = {k: sum(out["counts"][:k]) / total for k in (1024, 4096, 16384, 32768)
               if total and k < vocab}
    print(f"{total:,} tokens, {len(counts):,} distinct of {vocab:,}; the most frequent K cover "
          + ", ".join(f"{k}: {c:.1%}" for k, c in covered.items()) + f"; wrote {a.out}")
    return out


if __name__ == "__main__":
    main()
