"""The verifier: one decode window on the device, from drafts to the accepted-prefix commit.

For a window of NG groups x G rows (group g: slot s, pending token at position p, r valid rows):
  1. drafts: row 0 is the slot's pending token, row 1 its MTP draft; a group of G > 2 rows
     (a solo window) extends the draft chain with G - 2 more MTP steps, each feeding the
     mtp.norm output back as the next hidden state;
  2. verify: one forward over all rows, writing candidate K/V and, per row, each DeltaNet layer's
     rank-one state update factors [k | delta | decay] and conv snapshot;
  3. sample a target y_j for every row (position-keyed, so drafts and targets share noise);
     every sample in a window uses the filtering sampler when any of its requests filters
     (top-k / top-p), else the sort-free one: the host decides, since it is part of the graph;
  4. accept the longest prefix with d_(j+1) == y_j (j + 1 < r) -> a; under
     engine.synthetic_acceptance=p instead each draft is accepted with probability p given its
     predecessors (sampling.synthetic_prefix, keyed by seed and position), and the accepted
     drafts replace y_j for j < a, as if verified;
  5. commit: each DeltaNet layer replays rows 0..a's factors onto the slot's state (the state
     after row a, bit for bit) and takes the conv snapshot after row a, the slot advances to
     p + a + 1, y_a becomes the pending token;
  6. MTP over every committed row j with (h[j], y_j) -- y_j equals the next row's token for
     j < a, and is the new pending token for j = a -- so the slot's MTP KV has no holes; its
     row a yields the next draft.
Everything reads and writes device tensors with static shapes: the whole step is one CUDA graph.
The host reads back one small tensor per window: [y_0 .. y_(G-1), a, next draft] per group.
"""

from __future__ import annotations

from typing import Callable, Optional

import torch

from strata.engine.sampling import (accepted_prefix, sample_lanes, sample_plain_lanes,
                                   synthetic_window)
from strata.kernels import ops
from strata.model.qwen3_next import Qwen3Next
from strata.model.state import DecodeState


class SlotBuffers:
    """Per-slot device state the verifier reads and writes (index `lanes` is scratch)."""

    def __init__(self, lanes: int, hidden: int, dtype: torch.dtype, device):
        n = lanes + 1
        self.pos = torch.zeros(n, dtype=torch.long, device=device)
        self.pending = torch.zeros(n, dtype=torch.long, device=device)
        self.draft = torch.zeros(n, dtype=torch.long, device=device)
        self.mtp_h = torch.zeros(n, hidden, dtype=dtype, device=device)
        # Sampling parameters, two per lane in each table so that binding writes each table
        # in one kernel; the samplers read the columns.
        self.float_params = torch.zeros(n, 2, dtype=torch.float32, device=device)
        self.float_params[:, 1] = 1.0
        self.int_params = torch.zeros(n, 2, dtype=torch.long, device=device)
        self.temperature, self.top_p = self.float_params[:, 0], self.float_params[:, 1]
        self.top_k, self.seed = self.int_params[:, 0], self.int_params[:, 1]

    def set_params(self, lanes: "torch.Tensor", floats: "torch.Tensor", ints: "torch.Tensor") -> None:
        """Sampling parameters of the lanes `lanes` (a device index tensor): rows of
        (temperature, top_p) as float32 and of (top_k, seed) as int64, in two kernels."""
        self.float_params.index_copy_(0, lanes, floats)
        self.int_params.index_copy_(0, lanes, ints)


def window_inputs(pending: torch.Tensor, draft: torch.Tensor, mtp_h: torch.Tensor,
                  pos: torch.Tensor, gs: torch.Tensor, gp: torch.Tensor, scratch: int,
                  device_positions: bool):
    """A window's inputs, gathered by group in one region (a fused kernel or two where the
    eager glue ran one per gather): the groups' positions (read from `pos` under
    engine.overlap, padding groups at 0 of the scratch lane), pending tokens, drafts, MTP
    hidden states and the window's first two token columns [pending | draft] (NG, 2), so that
    a window of two rows per group stacks no tokens eagerly (a window of one row per group
    leaves the drafts unused: gathering them anyway keeps one compiled graph for every
    window)."""
    if device_positions:
        gp = torch.where(gs == scratch, 0, pos[gs])
    pending, draft = pending[gs], draft[gs]
    return gp, pending, draft, mtp_h[gs], torch.stack([pending, draft], 1)


def window_pick(mh: torch.Tensor, accept: torch.Tensor, gp: torch.Tensor):
    """Each group's MTP hidden state at its accepted row, and the position before the one its
    next draft predicts (p + a + 1: the drafts sample at offset 1, see Verifier._draft)."""
    idx = torch.arange(accept.shape[0], device=accept.device)
    return mh[idx, accept], gp + accept + 1


def window_store(pending: torch.Tensor, gs: torch.Tensor, y: torch.Tensor,
                 accept: torch.Tensor, draft: Optional[torch.Tensor] = None,
                 draft_buf: Optional[torch.Tensor] = None, mtp_h: Optional[torch.Tensor] = None,
                 h_a: Optional[torch.Tensor] = None) -> torch.Tensor:
    """The window's writes to the slot buffers in one region: y_a becomes each group's pending
    token, and with drafts the next draft and its MTP hidden state; returns the rows the host
    reads, [y_0 .. y_(G-1), a, next draft] per group (draft 0 without drafts)."""
    idx = torch.arange(accept.shape[0], device=accept.device)
    pending[gs] = y[idx, accept]
    if draft is None:
        draft = torch.zeros_like(accept)
    else:
        draft_buf[gs] = draft
        mtp_h[gs] = h_a
    return torch.cat([y, accept[:, None], draft[:, None]], 1)


#: The window glue among them: compiled with dynamic sizes from the first call, so that one
#: graph (two with dynamo's own one-group specialization) serves every window shape.
GLUE_FUNCTIONS = ("window_inputs", "window_pick", "window_store")
#: The verifier's pure functions, by name: what `compile_pure_functions` compiles.
PURE_FUNCTIONS = {"sample": sample_lanes, "sample_plain": sample_plain_lanes,
                  "accepted_prefix": accepted_prefix, "synthetic_window": synthetic_window,
                  "window_inputs": window_inputs, "window_pick": window_pick,
                  "window_store": window_store}


class Verifier:
    def __init__(self, model: Qwen3Next, state: DecodeState, bufs: SlotBuffers, drafting: bool,
                 split_keys: int = 0, functions: Optional[dict[str, Callable]] = None,
                 synthetic_acceptance: Optional[float] = None, expert_cache=None,
                 device_positions: bool = False, draft_ids: Optional[torch.Tensor] = None,
                 draft_head: Optional[torch.nn.Module] = None):
        """`split_keys`: the verify forward attention's split-K chunk in keys (0: the kernels'
        own plan; engine.batch_invariant fixes it). `functions`: replacements (compiled
        versions) for some of PURE_FUNCTIONS. `synthetic_acceptance` (engine knob): None
        verifies drafts; p in [0, 1] accepts each draft with probability p (benchmarks on
        dummy weights; the text is not the model's). `expert_cache`: the engine's ExpertCache
        (engine.expert_cache_mib > 0), whose hit/miss counts each window updates on the device.
        `device_positions` (engine.overlap): a window reads its groups' positions from
        `bufs.pos`, where the previous window's commit wrote them, since the host plans it
        before reading that window's accepted counts. `draft_ids` (engine.draft_vocab): the
        ascending token ids drafts choose among (None: every token); `draft_head`: the module
        drafts take their logits from, the LM head's rows for them or an FP8 copy
        (engine.draft_head; strata/engine/draft_vocab.py), None: the LM head itself."""
        self.model = model
        self.state = state
        self.bufs = bufs
        self.drafting = drafting
        self.split_keys = split_keys
        pure = {**PURE_FUNCTIONS, **(functions or {})}
        self.sample = pure["sample"]
        self.sample_plain = pure["sample_plain"]
        self.accepted_prefix = pure["accepted_prefix"]
        self.synthetic_window = pure["synthetic_window"]
        self.window_inputs = pure["window_inputs"]
        self.window_pick = pure["window_pick"]
        self.window_store = pure["window_store"]
        self.synthetic_acceptance = (None if synthetic_acceptance is None
                                     else float(synthetic_acceptance))
        #: strata.engine.expert_cache.ExpertCache, or None: a window starts and ends its counts.
        self.expert_cache = expert_cache
        self.device_positions = device_positions
        if draft_ids is not None and draft_head is None:
            raise ValueError("Verifier: draft_ids need the draft head of their rows")
        self.draft_ids, self.draft_head = draft_ids, draft_head

    def _sample(self, logits: torch.Tensor, lanes: torch.Tensor, pos0: torch.Tensor, rows_per: int,
                offset: int, filtered: bool, token: Optional[torch.Tensor] = None) -> torch.Tensor:
        """One token per row; lane i owns rows_per rows at positions pos0[i] + offset + j.
        `token`: the logits' columns' token ids (a draft vocabulary), None: the whole one."""
        b = self.bufs
        # the token ids are passed only when set: a sampler called with one argument fewer
        # keeps the compiled graphs it had before draft vocabularies existed
        extra = () if token is None else (token,)
        if filtered:
            return self.sample(logits, lanes, pos0, rows_per, offset, b.temperature, b.top_k,
                               b.top_p, b.seed, *extra)
        return self.sample_plain(logits, lanes, pos0, rows_per, offset, b.temperature, b.seed,
                                 *extra)

    def _draft(self, hidden: torch.Tensor, gs: torch.Tensor, before: torch.Tensor,
               filtered: bool) -> torch.Tensor:
        """One draft per lane at position before + 1 from the MTP's hidden states (the draft
        head: engine.draft_vocab's tokens, or the LM head). Every sampler call passes offset 1
        (the targets' y_j sits at p + j + 1), so the compiled samplers keep no graphs of their
        own for offset 0, an int they specialise on."""
        return self._sample(self.draft_logits(hidden), gs, before, 1, 1, filtered,
                            self.draft_ids)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The drafts' logits: over `draft_ids` only (their columns, in that order) with a draft
        vocabulary, else over every token; from the draft head, else the LM head."""
        if self.draft_head is None:
            return self.model.logits(hidden)
        return self.draft_head(hidden)

    def window(self, gs: torch.Tensor, gp: torch.Tensor, rows: torch.Tensor, g: int, ctx: int,
               filtered: bool) -> torch.Tensor:
        """Run one window; gs, gp, rows are (NG,) device tensors (gp is ignored under
        `device_positions`). Returns (NG, G + 2) int64.
        `filtered`: some request of the window filters (`SamplingParams.filtered`)."""
        model, state, bufs = self.model, self.state, self.bufs
        if self.expert_cache is not None:
            self.expert_cache.begin_window()
        ng = gs.shape[0]
        gp, pending, draft, h, pair = self.window_inputs(bufs.pending, bufs.draft, bufs.mtp_h,
                                                         bufs.pos, gs, gp, state.scratch,
                                                         self.device_positions)
        cols = [pair]
        tok, at = draft, gp
        for k in range(2, g):  # extend the chain: MTP at position p+k-2 predicts p+k
            nxt = gp + (k - 1)  # (each position added once: an eager kernel apiece)
            mh = model.mtp_window(h[:, None], tok[:, None], gs, at, ctx, state,
                                  with_logits=False)[0][:, 0]
            tok = self._draft(mh, gs, nxt, filtered)
            h, at = mh, nxt
            cols.append(tok[:, None])
        # one row a group: pending alone (a view); two: the pair as gathered; more: one cat
        tokens = pending[:, None] if g == 1 else pair if g == 2 else torch.cat(cols, 1)
        hidden, logits, rec_factors, conv_snaps = model.verify_window(tokens, gs, gp, ctx, state,
                                                                      self.split_keys)
        # target y_j sits at position p + j + 1
        y = self._sample(logits.reshape(ng * g, -1), gs, gp, g, 1, filtered).view(ng, g)
        if g > 1 and self.synthetic_acceptance is not None:
            accept, y = self.synthetic_window(tokens, y, rows, gs, gp, bufs.seed,
                                              self.synthetic_acceptance)
        elif g > 1:
            accept = self.accepted_prefix(tokens, y, rows)
        else:
            accept = torch.zeros(ng, dtype=torch.long, device=gs.device)
        ops.commit_accepted(accept, gs, gp, rec_factors, conv_snaps, state.rec, state.conv,
                            bufs.pos)
        if self.drafting:
            mh = model.mtp_window(hidden, y, gs, gp, ctx, state, with_logits=False)[0]
            h_a, before = self.window_pick(mh, accept, gp)
            draft = self._draft(h_a, gs, before, filtered)
            out = self.window_store(bufs.pending, gs, y, accept, draft, bufs.draft, bufs.mtp_h,
                                    h_a)
        else:
            out = self.window_store(bufs.pending, gs, y, accept)
        if self.expert_cache is not None:
            self.expert_cache.end_window()
        return out

    def prefill(self, tokens: torch.Tensor, meta: torch.Tensor, ctx: int,
                filtered: bool = True) -> torch.Tensor:
        """Run one prompt chunk, entirely on the device (so it can be one CUDA graph).

        tokens (B,): the chunk, padded to a bucket; meta (4,) int64: lane, start, length (real
        tokens), and the prompt token after the chunk, or -1 for the final chunk. The final
        chunk samples the first token and drafts; every chunk writes the lane's pending token,
        position and draft (a later chunk overwrites them). Returns (1,) int64: the first token
        for a final chunk, else the next prompt token. `filtered`: the request filters
        (`SamplingParams.filtered`), as a window's flag: the sorting sampler, else the plain
        one, which gives a request that does not filter the same tokens in a fraction of the
        kernels (at the tiny model's sizes two sorting samplers were over a quarter of a chunk).
        Several lanes' chunks at once (engine.prefill_slots): tokens (S, B) and meta (S, 4),
        one segment a row; returns (S,)."""
        model, state, bufs = self.model, self.state, self.bufs
        if tokens.dim() == 1:
            tokens, meta = tokens[None], meta[None]
        segs, n = tokens.shape
        lane, start, length, given = meta[:, 0], meta[:, 1], meta[:, 2], meta[:, 3]
        hidden = model.prefill(tokens, lane, start, state, length=length, ctx=ctx)  # (S, B, H)
        last = length - 1
        seg = torch.arange(segs, device=tokens.device)
        end = start + length
        # the first token sits at position end (offset 1 from end - 1, as every sampler call)
        first = self._sample(model.logits(hidden[seg, last]), lane, end - 1, 1, 1, filtered)
        nxt = torch.where(given < 0, first, given)
        bufs.pending.index_copy_(0, lane, nxt)
        bufs.pos.index_copy_(0, lane, end)
        if self.drafting:
            # MTP row i combines h[i] with the token after it: the prompt's next token, and at
            # the last real row the token that follows the chunk.
            rows = torch.arange(n, device=tokens.device)[None]
            next_tokens = torch.where(rows == last[:, None], nxt[:, None], tokens.roll(-1, dims=1))
            mh = model.mtp_window(hidden, next_tokens, lane, start, ctx, state, with_logits=False,
                                  variant="prefill", valid=rows < length[:, None])[0]
            h_last = mh[seg, last]
            bufs.draft.index_copy_(0, lane, self._draft(h_last, lane, end, filtered))
            bufs.mtp_h.index_copy_(0, lane, h_last)
        return nxt
