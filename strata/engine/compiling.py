"""torch.compile of a window step's pure regions, once per model (engines may share a model)."""

from __future__ import annotations

from typing import Callable

import torch

from strata.engine.verifier import PURE_FUNCTIONS


def compiled_functions(model) -> dict[str, Callable]:
    """Compile the model's regions (`model.compile_regions`) and the verifier's pure functions;
    returns the latter, by name, for the Verifier to be built with."""
    import torch._dynamo

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    # A region that fails to compile runs eagerly (logged by torch) instead of failing requests.
    torch._dynamo.config.suppress_errors = True
    compiled = getattr(model, "_strata_compiled", None)
    if compiled is None:
        fn = lambda f: torch.compile(f, dynamic=None)  # noqa: E731
        # Prompt chunks come in many lengths: compile them with symbolic lengths.
        pfn = lambda f: torch.compile(f, dynamic=True)  # noqa: E731
        model.compile_regions(fn, pfn)
        compiled = {name: torch.compile(f, dynamic=None) for name, f in PURE_FUNCTIONS.items()}
        model._strata_compiled = compiled
    return compiled
