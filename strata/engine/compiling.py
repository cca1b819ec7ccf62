"""torch.compile of a window step's pure regions, once per model (engines may share a model)."""

from __future__ import annotations

import copyreg
import os
from typing import Callable, Optional

import torch

from strata.engine.verifier import GLUE_FUNCTIONS, PURE_FUNCTIONS

#: Inductor's own switches; when the environment sets one, it wins over the default below.
PDL_ENV = "TORCHINDUCTOR_ENABLE_PDL"
DETERMINISTIC_ENV = "TORCHINDUCTOR_DETERMINISTIC"


def memory_format_named(name: str) -> torch.memory_format:
    return getattr(torch, name)


def _reduce_memory_format(m: torch.memory_format):
    return memory_format_named, (str(m).rpartition(".")[2],)


# Inductor's cache keys pickle each input's metadata, its memory format included, and a memory
# format pickles by a dotted name that pickle resolves against the first module in sys.modules
# holding `torch` (`torch._utils` in one process, a script's `__mp_main__` in another), so the
# same graph got other keys in processes that had imported their modules in another order: the
# compile workers' graphs were then never found (strata/engine/compile_workers.py). Pickled by
# this function instead, the key is the same in every process.
copyreg.pickle(torch.memory_format, _reduce_memory_format)


def pdl_default(device: torch.device, graphs: bool = True) -> bool:
    """Whether compiled regions launch their Triton kernels as programmatic dependent launches:
    on CUDA sm_90+ when the engine replays graphs (each kernel's launch and block scheduling
    then overlap the kernel before it; launched one by one from the host, the extra launch
    attributes cost host time instead), unless TORCHINDUCTOR_ENABLE_PDL says otherwise."""
    env = os.environ.get(PDL_ENV)
    if env:
        return env.strip() == "1"
    if not graphs or device.type != "cuda" or not torch.cuda.is_available() or torch.version.hip:
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


def deterministic_default() -> bool:
    """Whether compiled regions use inductor's deterministic mode: each reduction kernel takes
    one configuration chosen without timing it on the device. Timed, the choice (and with it a
    reduction's order, so bf16 bits and then greedy text) could differ between two cold
    compile caches: between machines, or runs beside other work. Pointwise kernels are still
    timed: their configuration changes no value. On unless TORCHINDUCTOR_DETERMINISTIC says
    otherwise."""
    env = os.environ.get(DETERMINISTIC_ENV)
    return env.strip() == "1" if env else True


def inductor_pdl() -> bool:
    """Whether compiled regions launch their kernels programmatically (for reports)."""
    import torch._inductor.config as inductor_config

    return bool(getattr(inductor_config.triton, "enable_pdl", False))


def specialize_one(on: bool) -> None:
    """engine.compile_specialize_one: whether regions compiled from now on give a size of 1
    graphs of their own (torch's default) or treat it as any other size of a dynamic dimension
    (backed_size_oblivious). Process-wide, read when a region traces."""
    import torch.fx.experimental._config as fx_config

    if not hasattr(fx_config, "backed_size_oblivious"):
        if not on:
            raise RuntimeError(f"engine.compile_specialize_one=false needs a torch with "
                               f"backed_size_oblivious; torch {torch.__version__} has none")
        return
    fx_config.backed_size_oblivious = not on


def duck_shape(on: bool) -> None:
    """Whether dynamic sizes that are equal when a region traces share one symbol (torch's duck
    shaping, its default). The engine turns it off: a prompt bucket of 16 rows was tied to a
    size of 16 in the same inputs (the 80B's query heads, the tiny model's head dimension),
    which the region then fixed, so the bucket of 32 recompiled the prompt regions (attention
    and DeltaNet, MoE included). Sizes that must be equal are still guarded equal. Process-wide,
    read when a region traces."""
    import torch.fx.experimental._config as fx_config

    fx_config.use_duck_shape = on


#: Inductor options of the prompt-chunk regions (compiled with symbolic lengths): no 2D tiling.
#: Inductor times a 2D-tiled reduction's configurations on the device even in deterministic mode,
#: and the choice changes its order: two cold caches at the FP8 80B shapes gave the prompt
#: chunk's DeltaNet q/k norms (read across the conv's transposed output) R0_BLOCK 64 in one and
#: 128 in the other, so other bf16 bits and another greedy text. Untiled, a reduction takes the
#: one configuration deterministic mode picks without timing. The options are in inductor's
#: cache keys, so the compile workers pass them too (one place: here).
PROMPT_REGION_OPTIONS = {"triton.max_tiles": 1}


def region_options(prompt: bool) -> dict:
    """Inductor options of a compiled region: deterministic mode (deterministic_default) and,
    for the prompt-chunk regions, PROMPT_REGION_OPTIONS. Deterministic mode goes in each
    region's options, not in inductor's process-wide flag: dynamo resets that flag to
    torch.are_deterministic_algorithms_enabled() after every frame it converts (it restores
    torch.use_deterministic_algorithms, which sets the flag too), so only the first region
    compiled would have had it, and every later one timed its reductions' configurations. The
    options are in inductor's cache keys, so the compile workers pass them too (one place:
    here)."""
    return {"deterministic": deterministic_default(), **(PROMPT_REGION_OPTIONS if prompt else {})}


#: The samplers: a prompt chunk passes its lanes as a column of its meta rows (stride 4), a
#: window as a contiguous row; dynamo guards on strides, so each would compile graphs of its own.
SAMPLERS = ("sample", "sample_plain")


def contiguous_lanes(sampler: Callable) -> Callable:
    """A compiled sampler called with its `lanes` (second argument) made contiguous: a prompt
    chunk's samples then run the window's graphs of the same shapes (one group: one row; several
    groups: the dynamic count), and compile none of their own. A window's lanes are a
    contiguous row already (no copy); a chunk's are S int64s, one small copy kernel,
    graph-capturable. (Not `contiguous()`: a one-segment column is contiguous with stride 4,
    and dynamo guards on that stride all the same.) Logits that are a view (a window's targets,
    reshaped) are passed detached, which copies nothing: dynamo guards on a view's base, so a
    window's targets and its drafts (logits of their own) compiled graphs of their own."""
    def call(logits, lanes, *rest):
        if lanes.stride() != (1,):
            lanes = lanes.clone(memory_format=torch.contiguous_format)
        if logits._base is not None:
            logits = logits.detach()
        return sampler(logits, lanes, *rest)

    return call


def compiled_functions(model, device: torch.device | None = None,
                       graphs: bool = True, one_apart: bool = True,
                       backend: Optional[Callable] = None) -> dict[str, Callable]:
    """Compile the model's regions (`model.compile_regions`) and the verifier's pure functions;
    returns the latter, by name, for the Verifier to be built with. `device` and `graphs` (the
    engine replays CUDA graphs) choose whether the regions' kernels launch programmatically;
    `one_apart` is engine.compile_specialize_one; `backend` ((dynamic, options) -> a
    torch.compile backend; None: inductor) is a compile worker's
    (strata/engine/compile_workers.py)."""
    import torch._dynamo
    import torch._inductor.config as inductor_config

    specialize_one(one_apart)
    duck_shape(False)

    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    # A region that fails to compile runs eagerly (logged by torch) instead of failing requests.
    torch._dynamo.config.suppress_errors = True
    # The layer's float attributes (norm epsilons) are constants, as in the window regions.
    # Dynamic (prompt-chunk) regions take the layer as an argument and would otherwise trace
    # them as symbolic floats, some of which AOTAutograd's scalar pass then makes dynamo trace
    # again specialised: a graph more in a process that compiles than in a compile worker
    # that runs the graph eagerly, whose numbering of the graphs after it then differs.
    torch._dynamo.config.specialize_float = True
    if device is not None and hasattr(inductor_config.triton, "enable_pdl"):
        # Process-wide, read when a region compiles (its first call): a decode window is a
        # chain of hundreds of small kernels whose launches then overlap (docs/BENCHMARKS.md,
        # "Programmatic launches"); eager windows would pay host time for it.
        inductor_config.triton.enable_pdl = pdl_default(device, graphs)
    compiled = getattr(model, "_strata_compiled", None)
    if compiled is None:
        def comp(f: Callable, dynamic: Optional[bool], prompt: bool = False) -> Callable:
            options = region_options(prompt)
            if backend is not None:
                return torch.compile(f, dynamic=dynamic, backend=backend(dynamic, options))
            return torch.compile(f, dynamic=dynamic, options=options)

        # Prompt chunks come in many lengths: compile them with symbolic lengths.
        model.compile_regions(lambda f: comp(f, None), lambda f: comp(f, True, prompt=True))
        compiled = {name: comp(f, True if name in GLUE_FUNCTIONS else None)
                    for name, f in PURE_FUNCTIONS.items()}
        for name in SAMPLERS:
            compiled[name] = contiguous_lanes(compiled[name])
        model._strata_compiled = compiled
    return compiled
