"""scripts/soak_graphs.py on CPU (the recording capture backend runs the same cache, LRU and
memory logic): it reaches its layout count, evicts, and loses nothing."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from strata.config import EMBEDDED_MODEL_DIR
from strata.model.loader import load_checkpoint


@pytest.mark.slow
def test_soak_reaches_its_layouts_with_no_crash_no_failure_and_flat_memory():
    from strata.tools import soak_graphs as mod

    device = torch.device("cpu")
    loaded = load_checkpoint(EMBEDDED_MODEL_DIR, "float32", device, log=lambda s: None)
    a = argparse.Namespace(slots=12, window_rows=8, limit=8, max_context=512, compile="off",
                           tier_min=64, seed=0, windows=150, min_layouts=40, max_seconds=120.0,
                           max_prompt=24, max_tokens=12, churn_windows=10, sample=25)
    r = mod.soak(loaded, device, a, reserve=2048, graph_key="layout")
    assert r["crashes"] == 0 and r["failed_requests"] == 0 and r["eager_windows"] == 0
    assert r["windows"] >= 150 and r["distinct_keys"] >= 40
    assert r["evictions"] > 0 and r["graphs_mib_held"] == 8 * 16.0  # the limit, 16 MiB a plan
    assert r["used_mib_spread_after_first_evict"] == 0.0
    assert r["used_mib_max_rise_after_first_evict"] == 0.0
    assert r["non_graph_mib_spread_after_first_evict"] == 0.0
    assert all(len(point) == 3 for point in r["curve"])  # (window, used MiB, graphs MiB held)
