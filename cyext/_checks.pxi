# Argument checks shared by strata_cpu.pyx and strata_cuda.pyx (textually included).
# They work on torch tensors through their Python API only (dtype, device, shape, stride,
# data_ptr), so no torch C++ headers are needed to build the extensions.

from libc.stdint cimport int64_t, uintptr_t

import torch as _torch

# run-time element-type codes of strata_common.h
DTYPE_F32 = 0
DTYPE_BF16 = 1
DTYPE_F16 = 2
_CODES = {_torch.float32: 0, _torch.bfloat16: 1, _torch.float16: 2}
_NAMES = {0: "float32", 1: "bfloat16", 2: "float16"}
FLOATS = (0, 1, 2)


cdef int _check_tensor(str op, str name, object t, int ndim) except -1:
    if not isinstance(t, _torch.Tensor):
        raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{op}: {name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    return 0


cdef int _dtype_code(str op, str name, object t, tuple allowed=FLOATS) except -1:
    code = _CODES.get(t.dtype, -1)
    if code not in allowed:
        want = ", ".join(_NAMES[c] for c in allowed)
        raise TypeError(f"{op}: {name} has dtype {t.dtype}; expected {want}")
    return code


cdef int _check_index(str op, str name, object t, int64_t n) except -1:
    _check_tensor(op, name, t, 1)
    if t.dtype != _torch.int64:
        raise TypeError(f"{op}: {name} has dtype {t.dtype}; expected int64")
    if n >= 0 and t.shape[0] != n:
        raise ValueError(f"{op}: {name} must have shape ({n},), got {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous")
    return 0


cdef int _check_shape(str op, str name, object t, tuple shape) except -1:
    """shape entries of None match anything."""
    got = tuple(t.shape)
    if len(got) != len(shape) or any(w is not None and g != w for g, w in zip(got, shape)):
        want = "(" + ", ".join("*" if w is None else str(w) for w in shape) + ")"
        raise ValueError(f"{op}: {name} must have shape {want}, got {got}")
    return 0


cdef int _check_contiguous(str op, str name, object t) except -1:
    if not t.is_contiguous():
        raise ValueError(f"{op}: {name} must be contiguous (call .contiguous() first)")
    return 0


cdef int _check_inner_dense(str op, str name, object t, int first) except -1:
    """Dimensions first.. of t must be densely packed (outer dimensions may be strided)."""
    cdef int64_t expect = 1
    for i in range(t.dim() - 1, first - 1, -1):
        if t.shape[i] != 1 and t.stride(i) != expect:
            raise ValueError(
                f"{op}: {name} must be densely packed in its dimensions {first}.. "
                f"(shape {tuple(t.shape)}, strides {t.stride()})")
        expect *= t.shape[i]
    return 0


cdef inline void* _ptr(object t):
    return <void*><uintptr_t>t.data_ptr()
