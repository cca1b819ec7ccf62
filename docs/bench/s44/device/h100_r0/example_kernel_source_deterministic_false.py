# AOT ID: ['14_inference']
from ctypes import c_void_p, c_long, c_int
import torch
import math
import random
import os
import tempfile
from math import inf, nan
from cmath import nanj
from torch._inductor.hooks import run_intermediate_hooks
from torch._inductor.utils import maybe_profile
from torch._inductor.codegen.memory_planning import _align as align
from torch import device, empty_strided
from torch._inductor.async_compile import AsyncCompile
from torch._inductor.select_algorithm import extern_kernels
import triton
import triton.language as tl
from torch._inductor.runtime.triton_heuristics import start_graph, end_graph
from torch._C import _cuda_getCurrentRawStream as get_raw_stream

aten = torch.ops.aten
inductor_ops = torch.ops.inductor
_quantized = torch.ops._quantized
assert_size_stride = torch._C._dynamo.guards.assert_size_stride
assert_alignment = torch._C._dynamo.guards.assert_alignment
empty_strided_cpu = torch._C._dynamo.guards._empty_strided_cpu
empty_strided_cpu_pinned = torch._C._dynamo.guards._empty_strided_cpu_pinned
empty_strided_cuda = torch._C._dynamo.guards._empty_strided_cuda
empty_strided_xpu = torch._C._dynamo.guards._empty_strided_xpu
empty_strided_mtia = torch._C._dynamo.guards._empty_strided_mtia
reinterpret_tensor = torch._C._dynamo.guards._reinterpret_tensor
alloc_from_pool = torch.ops.inductor._alloc_from_pool
async_compile = AsyncCompile()
empty_strided_p2p = torch._C._distributed_c10d._SymmetricMemory.empty_strided_p2p


# kernel path: /tmp/ind_c1/q7/cq7lszznzg25ows2jl5f7wp3rp3fagphmomxeypxtumpcss3ardo.py
# Topologically Sorted Source Nodes: [xf, pow_1, mean, add, rsqrt, xf_1, float_2, add_1, mul_1, to], Original ATen: [aten._to_copy, aten.pow, aten.mean, aten.add, aten.rsqrt, aten.mul]
# Source node to ATen node mapping:
#   add => add_9
#   add_1 => add_19
#   float_2 => convert_element_type_1
#   mean => mean
#   mul_1 => mul_16
#   pow_1 => pow_1
#   rsqrt => rsqrt
#   to => convert_element_type_2
#   xf => convert_element_type
#   xf_1 => mul_12
# Graph fragment:
#   %arg1_1 : Tensor "bf16[1, s27, 2048][2048*s27, 2048, 1]cuda:0" = PlaceHolder[target=arg1_1]
#   %buf0 : Tensor "f32[1, s27, 1][s27, 1, s27]cuda:0" = PlaceHolder[target=buf0]
#   %arg2_1 : Tensor "bf16[2048][1]cuda:0" = PlaceHolder[target=arg2_1]
#   %convert_element_type : Tensor "f32[1, s27, 2048][2048*s27, 2048, 1]cuda:0"[num_users=2] = call_function[target=torch.ops.prims.convert_element_type.default](args = (%arg1_1, torch.float32), kwargs = {})
#   %pow_1 : Tensor "f32[1, s27, 2048][2048*s27, 2048, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.pow.Tensor_Scalar](args = (%convert_element_type, 2), kwargs = {})
#   %mean : Tensor "f32[1, s27, 1][s27, 1, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mean.dim](args = (%pow_1, [-1], True), kwargs = {})
#   %add_9 : Tensor "f32[1, s27, 1][s27, 1, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.add.Tensor](args = (%mean, 1e-06), kwargs = {})
#   %rsqrt : Tensor "f32[1, s27, 1][s27, 1, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.rsqrt.default](args = (%add_9,), kwargs = {})
#   %mul_12 : Tensor "f32[1, s27, 2048][2048*s27, 2048, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mul.Tensor](args = (%convert_element_type, %rsqrt), kwargs = {})
#   %convert_element_type_1 : Tensor "f32[2048][1]cuda:0"[num_users=1] = call_function[target=torch.ops.prims.convert_element_type.default](args = (%arg2_1, torch.float32), kwargs = {})
#   %add_19 : Tensor "f32[2048][1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.add.Tensor](args = (%convert_element_type_1, 1.0), kwargs = {})
#   %mul_16 : Tensor "f32[1, s27, 2048][2048*s27, 2048, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mul.Tensor](args = (%mul_12, %add_19), kwargs = {})
#   %convert_element_type_2 : Tensor "bf16[1, s27, 2048][2048*s27, 2048, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.prims.convert_element_type.default](args = (%mul_16, torch.bfloat16), kwargs = {})
#   return %buf0,%convert_element_type_2
triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0 = async_compile.triton('triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0', '''
import triton
import triton.language as tl

from torch._inductor.runtime import triton_helpers, triton_heuristics
from torch._inductor.runtime.triton_helpers import libdevice, math as tl_math
from torch._inductor.runtime.hints import AutotuneHint, ReductionHint, TileHint, DeviceProperties
triton_helpers.set_driver_to_gpu()

@triton_heuristics.reduction(
    size_hints={'x': 2, 'r0_': 2048},
    reduction_hint=ReductionHint.INNER,
    filename=__file__,
    triton_meta={'signature': {'in_ptr0': '*bf16', 'in_ptr1': '*bf16', 'out_ptr1': '*bf16', 'xnumel': 'i32', 'r0_numel': 'i32', 'XBLOCK': 'constexpr', 'R0_BLOCK': 'constexpr'}, 'device': DeviceProperties(type='cuda', index=0, multi_processor_count=132, cc=90, major=9, regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048, max_threads_per_block=1024, warp_size=32), 'constants': {}, 'native_matmul': False, 'enable_fp_fusion': True, 'launch_pdl': True, 'disable_ftz': False, 'configs': [{(0,): [['tt.divisibility', 16]], (1,): [['tt.divisibility', 16]], (2,): [['tt.divisibility', 16]], (4,): [['tt.divisibility', 16]]}]},
    inductor_meta={'grid_type': 'Grid1D', 'autotune_hints': set(), 'kernel_name': 'triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0', 'mutated_arg_names': [], 'optimize_mem': True, 'no_x_dim': False, 'atomic_add_found': False, 'num_load': 3, 'num_store': 1, 'num_reduction': 1, 'backend_hash': '91D1D1166449D9E2EB66EB9770C9E2C3B0FEB787341F27FEB4D3F0338DA50336', 'assert_indirect_indexing': True, 'autotune_local_cache': True, 'autotune_pointwise': True, 'autotune_remote_cache': None, 'force_disable_caches': False, 'dynamic_scale_rblock': True, 'max_autotune': False, 'max_autotune_pointwise': False, 'min_split_scan_rblock': 256, 'spill_threshold': 16, 'store_cubin': False, 'deterministic': False, 'force_filter_reduction_configs': False, 'mix_order_reduction_allow_multi_stages': False, 'are_deterministic_algorithms_enabled': False, 'tiling_scores': {'x': 0, 'r0_': 28672}}
)
@triton.jit
def triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0(in_ptr0, in_ptr1, out_ptr1, xnumel, r0_numel, XBLOCK : tl.constexpr, R0_BLOCK : tl.constexpr):
    r0_numel = 2048
    rnumel = r0_numel
    RBLOCK: tl.constexpr = R0_BLOCK
    xoffset = tl.program_id(0) * XBLOCK
    xindex = xoffset + tl.arange(0, XBLOCK)[:, None]
    xmask = xindex < xnumel
    r0_base = tl.arange(0, R0_BLOCK)[None, :]
    rbase = r0_base
    x0 = xindex
    tl.extra.cuda.gdc_wait()
    _tmp4 = tl.full([XBLOCK, R0_BLOCK], 0, tl.float32)
    for r0_offset in tl.range(0, r0_numel, R0_BLOCK):
        r0_index = r0_offset + r0_base
        r0_mask = r0_index < r0_numel
        roffset = r0_offset
        rindex = r0_index
        r0_1 = r0_index
        tmp0 = tl.load(in_ptr0 + (r0_1 + 2048*x0), r0_mask & xmask, eviction_policy='evict_last', other=0.0).to(tl.float32)
        tmp1 = tmp0.to(tl.float32)
        tmp2 = tmp1 * tmp1
        tmp3 = tl.broadcast_to(tmp2, [XBLOCK, R0_BLOCK])
        tmp5 = _tmp4 + tmp3
        _tmp4 = tl.where(r0_mask & xmask, tmp5, _tmp4)
    tmp4 = tl.sum(_tmp4, 1)[:, None]
    for r0_offset in tl.range(0, r0_numel, R0_BLOCK):
        r0_index = r0_offset + r0_base
        r0_mask = r0_index < r0_numel
        roffset = r0_offset
        rindex = r0_index
        r0_1 = r0_index
        tmp6 = tl.load(in_ptr0 + (r0_1 + 2048*x0), r0_mask & xmask, eviction_policy='evict_first', other=0.0).to(tl.float32)
        tmp14 = tl.load(in_ptr1 + (r0_1), r0_mask, eviction_policy='evict_last', other=0.0).to(tl.float32)
        tmp7 = tmp6.to(tl.float32)
        tmp8 = tl.full([1, 1], 2048.0, tl.float32)
        tmp9 = (tmp4 / tmp8)
        tmp10 = tl.full([1, 1], 1e-06, tl.float32)
        tmp11 = tmp9 + tmp10
        tmp12 = libdevice.rsqrt(tmp11)
        tmp13 = tmp7 * tmp12
        tmp15 = tmp14.to(tl.float32)
        tmp16 = tl.full([1, 1], 1.0, tl.float32)
        tmp17 = tmp15 + tmp16
        tmp18 = tmp13 * tmp17
        tmp19 = tmp18.to(tl.float32)
        tl.store(out_ptr1 + (r0_1 + 2048*x0), tmp19, r0_mask & xmask)
    tl.extra.cuda.gdc_launch_dependents()
''', device_str='cuda')


# kernel path: /tmp/ind_c1/y4/cy46c554ysv2z6a6sbk62nfdzuapqqz6fugy4hn25rhhbihokygw.py
# Topologically Sorted Source Nodes: [pow_2, mean_1], Original ATen: [aten.pow, aten.mean]
# Source node to ATen node mapping:
#   mean_1 => mean_1
#   pow_2 => pow_2
# Graph fragment:
#   %gated_delta_window_prep_factors_into_default : Tensor "f32[1, s27, 32, 128][4096*s27, 4096, 128, 1]cuda:0" = PlaceHolder[target=gated_delta_window_prep_factors_into_default]
#   %pow_2 : Tensor "f32[1, s27, 32, 128][4096*s27, 4096, 128, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.pow.Tensor_Scalar](args = (%gated_delta_window_prep_factors_into_default, 2), kwargs = {})
#   %mean_1 : Tensor "f32[1, s27, 32, 1][32*s27, 32, 1, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mean.dim](args = (%pow_2, [-1], True), kwargs = {})
#   return %buf9
triton_per_fused_mean_pow_1 = async_compile.triton('triton_per_fused_mean_pow_1', '''
import triton
import triton.language as tl

from torch._inductor.runtime import triton_helpers, triton_heuristics
from torch._inductor.runtime.triton_helpers import libdevice, math as tl_math
from torch._inductor.runtime.hints import AutotuneHint, ReductionHint, TileHint, DeviceProperties
triton_helpers.set_driver_to_gpu()

@triton_heuristics.persistent_reduction(
    size_hints={'x': 64, 'r0_': 128},
    reduction_hint=ReductionHint.INNER,
    filename=__file__,
    triton_meta={'signature': {'in_ptr0': '*fp32', 'out_ptr0': '*fp32', 'xnumel': 'i32', 'r0_numel': 'i32', 'XBLOCK': 'constexpr'}, 'device': DeviceProperties(type='cuda', index=0, multi_processor_count=132, cc=90, major=9, regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048, max_threads_per_block=1024, warp_size=32), 'constants': {}, 'native_matmul': False, 'enable_fp_fusion': True, 'launch_pdl': True, 'disable_ftz': False, 'configs': [{(0,): [['tt.divisibility', 16]], (1,): [['tt.divisibility', 16]], (2,): [['tt.divisibility', 16]], (3,): [['tt.divisibility', 16]]}]},
    inductor_meta={'grid_type': 'Grid1D', 'autotune_hints': set(), 'kernel_name': 'triton_per_fused_mean_pow_1', 'mutated_arg_names': [], 'optimize_mem': True, 'no_x_dim': None, 'atomic_add_found': False, 'num_load': 1, 'num_store': 1, 'num_reduction': 1, 'backend_hash': '91D1D1166449D9E2EB66EB9770C9E2C3B0FEB787341F27FEB4D3F0338DA50336', 'assert_indirect_indexing': True, 'autotune_local_cache': True, 'autotune_pointwise': True, 'autotune_remote_cache': None, 'force_disable_caches': False, 'dynamic_scale_rblock': True, 'max_autotune': False, 'max_autotune_pointwise': False, 'min_split_scan_rblock': 256, 'spill_threshold': 16, 'store_cubin': False, 'deterministic': False, 'force_filter_reduction_configs': False, 'mix_order_reduction_allow_multi_stages': False, 'are_deterministic_algorithms_enabled': False, 'tiling_scores': {'x': 512, 'r0_': 32768}}
)
@triton.jit
def triton_per_fused_mean_pow_1(in_ptr0, out_ptr0, xnumel, r0_numel, XBLOCK : tl.constexpr):
    r0_numel = 128
    R0_BLOCK: tl.constexpr = 128
    rnumel = r0_numel
    RBLOCK: tl.constexpr = R0_BLOCK
    xoffset = tl.program_id(0) * XBLOCK
    xindex = xoffset + tl.arange(0, XBLOCK)[:, None]
    xmask = xindex < xnumel
    r0_index = tl.arange(0, R0_BLOCK)[None, :]
    r0_offset = 0
    r0_mask = tl.full([R0_BLOCK], True, tl.int1)[None, :]
    roffset = r0_offset
    rindex = r0_index
    r0_1 = r0_index
    x0 = xindex
    tl.extra.cuda.gdc_wait()
    tmp0 = tl.load(in_ptr0 + (r0_1 + 128*x0), xmask, other=0.0)
    tl.extra.cuda.gdc_launch_dependents()
    tmp1 = tmp0 * tmp0
    tmp2 = tl.broadcast_to(tmp1, [XBLOCK, R0_BLOCK])
    tmp4 = tl.where(xmask, tmp2, 0)
    tmp5 = tl.sum(tmp4, 1)[:, None].to(tl.float32)
    tl.store(out_ptr0 + (x0), tmp5, xmask)
''', device_str='cuda')


# kernel path: /tmp/ind_c1/a5/ca52udsa7prxyfwb7eelynvln6mkg77hribnfqlehjad3ax5kqta.py
# Topologically Sorted Source Nodes: [linear, split, pow_2, mean_1, add_2, rsqrt_1, xf_3, to_2, out, view, z, z_1, float_4, silu, mul_4, out_1, reshape_1, h], Original ATen: [aten._unsafe_view, aten.split_with_sizes, aten.pow, aten.mean, aten.add, aten.rsqrt, aten.mul, aten._to_copy, aten.view, aten.slice, aten.clone, aten.silu, strata.linear_fp8]
# Source node to ATen node mapping:
#   add_2 => add_84
#   float_4 => convert_element_type_8
#   h => linear_fp8
#   linear => view_1
#   mean_1 => mean_1
#   mul_4 => mul_116
#   out => mul_106
#   out_1 => convert_element_type_9
#   pow_2 => pow_2
#   reshape_1 => view_4
#   rsqrt_1 => rsqrt_1
#   silu => add_109, div, exp, neg
#   split => split_with_sizes
#   to_2 => convert_element_type_7
#   view => view_2
#   xf_3 => mul_99
#   z => slice_1
#   z_1 => clone, view_3
# Graph fragment:
#   %arg12_1 : Tensor "bf16[128][1]cuda:0" = PlaceHolder[target=arg12_1]
#   %gated_delta_window_prep_factors_into_default : Tensor "f32[1, s27, 32, 128][4096*s27, 4096, 128, 1]cuda:0" = PlaceHolder[target=gated_delta_window_prep_factors_into_default]
#   %buf9 : Tensor "f32[1, s27, 32, 1][32*s27, 32, 1, 32*s27]cuda:0" = PlaceHolder[target=buf9]
#   %mm : Tensor "bf16[s27, 12352][12352, 1]cuda:0" = PlaceHolder[target=mm]
#   %view_1 : Tensor "bf16[1, s27, 12352][12352*s27, 12352, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.reshape.default](args = (%mm, [1, %arg0_1, 12352]), kwargs = {})
#   %split_with_sizes : [num_users=2] = call_function[target=torch.ops.aten.split_with_sizes.default](args = (%view_1, [12288, 64], -1), kwargs = {})
#   %pow_2 : Tensor "f32[1, s27, 32, 128][4096*s27, 4096, 128, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.pow.Tensor_Scalar](args = (%gated_delta_window_prep_factors_into_default, 2), kwargs = {})
#   %mean_1 : Tensor "f32[1, s27, 32, 1][32*s27, 32, 1, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mean.dim](args = (%pow_2, [-1], True), kwargs = {})
#   %add_84 : Tensor "f32[1, s27, 32, 1][32*s27, 32, 1, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.add.Tensor](args = (%mean_1, 1e-06), kwargs = {})
#   %rsqrt_1 : Tensor "f32[1, s27, 32, 1][32*s27, 32, 1, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.rsqrt.default](args = (%add_84,), kwargs = {})
#   %mul_99 : Tensor "f32[1, s27, 32, 128][4096*s27, 4096, 128, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mul.Tensor](args = (%gated_delta_window_prep_factors_into_default, %rsqrt_1), kwargs = {})
#   %convert_element_type_7 : Tensor "bf16[1, s27, 32, 128][4096*s27, 4096, 128, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.prims.convert_element_type.default](args = (%mul_99, torch.bfloat16), kwargs = {})
#   %mul_106 : Tensor "bf16[1, s27, 32, 128][4096*s27, 4096, 128, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mul.Tensor](args = (%arg12_1, %convert_element_type_7), kwargs = {})
#   %view_2 : Tensor "bf16[1, s27, 16, 768][12352*s27, 12352, 768, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.reshape.default](args = (%getitem, [1, %arg0_1, 16, 768]), kwargs = {})
#   %slice_1 : Tensor "bf16[1, s27, 16, 256][12352*s27, 12352, 768, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.slice.Tensor](args = (%view_2, 3, 512, 9223372036854775807), kwargs = {})
#   %clone : Tensor "bf16[1, s27, 16, 256][4096*s27, 4096, 256, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.clone.default](args = (%slice_1,), kwargs = {memory_format: torch.contiguous_format})
#   %view_3 : Tensor "bf16[1, s27, 32, 128][4096*s27, 4096, 128, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.reshape.default](args = (%clone, [1, %arg0_1, 32, 128]), kwargs = {})
#   %convert_element_type_8 : Tensor "f32[1, s27, 32, 128][4096*s27, 4096, 128, 1]cuda:0"[num_users=2] = call_function[target=torch.ops.prims.convert_element_type.default](args = (%view_3, torch.float32), kwargs = {})
#   %neg : Tensor "f32[1, s27, 32, 128][4096*s27, 4096, 128, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.neg.default](args = (%convert_element_type_8,), kwargs = {})
#   %exp : Tensor "f32[1, s27, 32, 128][4096*s27, 4096, 128, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.exp.default](args = (%neg,), kwargs = {})
#   %add_109 : Tensor "f32[1, s27, 32, 128][4096*s27, 4096, 128, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.add.Tensor](args = (%exp, 1), kwargs = {})
#   %div : Tensor "f32[1, s27, 32, 128][4096*s27, 4096, 128, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.div.Tensor](args = (%convert_element_type_8, %add_109), kwargs = {})
#   %mul_116 : Tensor "f32[1, s27, 32, 128][4096*s27, 4096, 128, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mul.Tensor](args = (%mul_106, %div), kwargs = {})
#   %convert_element_type_9 : Tensor "bf16[1, s27, 32, 128][4096*s27, 4096, 128, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.prims.convert_element_type.default](args = (%mul_116, torch.bfloat16), kwargs = {})
#   %view_4 : Tensor "bf16[1, s27, 4096][4096*s27, 4096, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.reshape.default](args = (%convert_element_type_9, [1, %arg0_1, 4096]), kwargs = {})
#   %linear_fp8 : Tensor "bf16[1, s27, 2048][2048*s27, 2048, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.strata.linear_fp8.default](args = (%view_4, %arg13_1, %arg14_1, [128, 128]), kwargs = {})
#   return %buf10
triton_poi_fused__to_copy__unsafe_view_add_clone_linear_fp8_mean_mul_pow_rsqrt_silu_slice_split_with_sizes_view_2 = async_compile.triton('triton_poi_fused__to_copy__unsafe_view_add_clone_linear_fp8_mean_mul_pow_rsqrt_silu_slice_split_with_sizes_view_2', '''
import triton
import triton.language as tl

from torch._inductor.runtime import triton_helpers, triton_heuristics
from torch._inductor.runtime.triton_helpers import libdevice, math as tl_math
from torch._inductor.runtime.hints import AutotuneHint, ReductionHint, TileHint, DeviceProperties
triton_helpers.set_driver_to_gpu()

@triton_heuristics.pointwise(
    size_hints={'x': 8192}, 
    filename=__file__,
    triton_meta={'signature': {'in_ptr0': '*bf16', 'in_ptr1': '*fp32', 'in_ptr2': '*fp32', 'in_ptr3': '*bf16', 'out_ptr0': '*bf16', 'ks0': 'i64', 'xnumel': 'i32', 'XBLOCK': 'constexpr'}, 'device': DeviceProperties(type='cuda', index=0, multi_processor_count=132, cc=90, major=9, regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048, max_threads_per_block=1024, warp_size=32), 'constants': {}, 'native_matmul': False, 'enable_fp_fusion': True, 'launch_pdl': True, 'disable_ftz': False, 'configs': [{(0,): [['tt.divisibility', 16]], (1,): [['tt.divisibility', 16]], (2,): [['tt.divisibility', 16]], (3,): [['tt.divisibility', 16]], (4,): [['tt.divisibility', 16]], (6,): [['tt.divisibility', 16]]}]},
    inductor_meta={'grid_type': 'Grid1D', 'autotune_hints': set(), 'kernel_name': 'triton_poi_fused__to_copy__unsafe_view_add_clone_linear_fp8_mean_mul_pow_rsqrt_silu_slice_split_with_sizes_view_2', 'mutated_arg_names': [], 'optimize_mem': True, 'no_x_dim': False, 'atomic_add_found': False, 'num_load': 4, 'num_store': 1, 'num_reduction': 0, 'backend_hash': '91D1D1166449D9E2EB66EB9770C9E2C3B0FEB787341F27FEB4D3F0338DA50336', 'assert_indirect_indexing': True, 'autotune_local_cache': True, 'autotune_pointwise': True, 'autotune_remote_cache': None, 'force_disable_caches': False, 'dynamic_scale_rblock': True, 'max_autotune': False, 'max_autotune_pointwise': False, 'min_split_scan_rblock': 256, 'spill_threshold': 16, 'store_cubin': False, 'deterministic': False, 'force_filter_reduction_configs': False, 'mix_order_reduction_allow_multi_stages': False, 'are_deterministic_algorithms_enabled': False, 'tiling_scores': {'x': 82432}},
    min_elem_per_thread=0
)
@triton.jit
def triton_poi_fused__to_copy__unsafe_view_add_clone_linear_fp8_mean_mul_pow_rsqrt_silu_slice_split_with_sizes_view_2(in_ptr0, in_ptr1, in_ptr2, in_ptr3, out_ptr0, ks0, xnumel, XBLOCK : tl.constexpr):
    xoffset = tl.program_id(0) * XBLOCK
    xindex = xoffset + tl.arange(0, XBLOCK)[:]
    xmask = tl.full([XBLOCK], True, tl.int1)[:]
    x2 = xindex
    x0 = (xindex % 4096)
    x1 = xindex // 4096
    tmp0 = tl.load(in_ptr0 + ((x2 % 128)), None, eviction_policy='evict_last').to(tl.float32)
    tl.extra.cuda.gdc_wait()
    tmp1 = tl.load(in_ptr1 + (x2), None)
    tmp2 = tl.load(in_ptr2 + (x2 // 128), None, eviction_policy='evict_last')
    tmp12 = tl.load(in_ptr3 + (512 + 768*((128*(x0 // 128) + ((x0 % 128))) // 256) + 12352*((((128*(x0 // 128) + 4096*x1 + ((x0 % 128))) // 4096) % ks0)) + (((128*(x0 // 128) + ((x0 % 128))) % 256))), None, eviction_policy='evict_last').to(tl.float32)
    tl.extra.cuda.gdc_launch_dependents()
    tmp3 = tl.full([1], 128.0, tl.float32)
    tmp4 = (tmp2 / tmp3)
    tmp5 = tl.full([1], 1e-06, tl.float32)
    tmp6 = tmp4 + tmp5
    tmp7 = libdevice.rsqrt(tmp6)
    tmp8 = tmp1 * tmp7
    tmp9 = tmp8.to(tl.float32)
    tmp10 = tmp0 * tmp9
    tmp11 = tmp10.to(tl.float32)
    tmp13 = tmp12.to(tl.float32)
    tmp14 = -tmp13
    tmp15 = libdevice.exp(tmp14)
    tmp16 = tl.full([1], 1.0, tl.float32)
    tmp17 = tmp15 + tmp16
    tmp18 = (tmp13 / tmp17)
    tmp19 = tmp11 * tmp18
    tmp20 = tmp19.to(tl.float32)
    tl.store(out_ptr0 + (x2), tmp20, None)
''', device_str='cuda')


# kernel path: /tmp/ind_c1/ct/cctfbptybuhwhagruwpuklk6y6spuhvhte6odtmsajox3jsxb3b6.py
# Topologically Sorted Source Nodes: [add_3, xf_4, pow_3, mean_2, add_4, rsqrt_2, xf_5, float_6, add_5, mul_6, to_4], Original ATen: [aten.add, aten._to_copy, aten.pow, aten.mean, aten.rsqrt, aten.mul]
# Source node to ATen node mapping:
#   add_3 => add_128
#   add_4 => add_141
#   add_5 => add_151
#   float_6 => convert_element_type_11
#   mean_2 => mean_2
#   mul_6 => mul_152
#   pow_3 => pow_3
#   rsqrt_2 => rsqrt_2
#   to_4 => convert_element_type_12
#   xf_4 => convert_element_type_10
#   xf_5 => mul_148
# Graph fragment:
#   %arg1_1 : Tensor "bf16[1, s27, 2048][2048*s27, 2048, 1]cuda:0" = PlaceHolder[target=arg1_1]
#   %linear_fp8 : Tensor "bf16[1, s27, 2048][2048*s27, 2048, 1]cuda:0" = PlaceHolder[target=linear_fp8]
#   %buf13 : Tensor "f32[1, s27, 1][s27, 1, s27]cuda:0" = PlaceHolder[target=buf13]
#   %arg15_1 : Tensor "bf16[2048][1]cuda:0" = PlaceHolder[target=arg15_1]
#   %add_128 : Tensor "bf16[1, s27, 2048][2048*s27, 2048, 1]cuda:0"[num_users=2] = call_function[target=torch.ops.aten.add.Tensor](args = (%arg1_1, %linear_fp8), kwargs = {})
#   %convert_element_type_10 : Tensor "f32[1, s27, 2048][2048*s27, 2048, 1]cuda:0"[num_users=2] = call_function[target=torch.ops.prims.convert_element_type.default](args = (%add_128, torch.float32), kwargs = {})
#   %pow_3 : Tensor "f32[1, s27, 2048][2048*s27, 2048, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.pow.Tensor_Scalar](args = (%convert_element_type_10, 2), kwargs = {})
#   %mean_2 : Tensor "f32[1, s27, 1][s27, 1, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mean.dim](args = (%pow_3, [-1], True), kwargs = {})
#   %add_141 : Tensor "f32[1, s27, 1][s27, 1, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.add.Tensor](args = (%mean_2, 1e-06), kwargs = {})
#   %rsqrt_2 : Tensor "f32[1, s27, 1][s27, 1, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.rsqrt.default](args = (%add_141,), kwargs = {})
#   %mul_148 : Tensor "f32[1, s27, 2048][2048*s27, 2048, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mul.Tensor](args = (%convert_element_type_10, %rsqrt_2), kwargs = {})
#   %convert_element_type_11 : Tensor "f32[2048][1]cuda:0"[num_users=1] = call_function[target=torch.ops.prims.convert_element_type.default](args = (%arg15_1, torch.float32), kwargs = {})
#   %add_151 : Tensor "f32[2048][1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.add.Tensor](args = (%convert_element_type_11, 1.0), kwargs = {})
#   %mul_152 : Tensor "f32[1, s27, 2048][2048*s27, 2048, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mul.Tensor](args = (%mul_148, %add_151), kwargs = {})
#   %convert_element_type_12 : Tensor "bf16[1, s27, 2048][2048*s27, 2048, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.prims.convert_element_type.default](args = (%mul_152, torch.bfloat16), kwargs = {})
#   return %buf13,%convert_element_type_12
triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_3 = async_compile.triton('triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_3', '''
import triton
import triton.language as tl

from torch._inductor.runtime import triton_helpers, triton_heuristics
from torch._inductor.runtime.triton_helpers import libdevice, math as tl_math
from torch._inductor.runtime.hints import AutotuneHint, ReductionHint, TileHint, DeviceProperties
triton_helpers.set_driver_to_gpu()

@triton_heuristics.reduction(
    size_hints={'x': 2, 'r0_': 2048},
    reduction_hint=ReductionHint.INNER,
    filename=__file__,
    triton_meta={'signature': {'in_ptr0': '*bf16', 'in_ptr1': '*bf16', 'in_ptr2': '*bf16', 'out_ptr1': '*bf16', 'xnumel': 'i32', 'r0_numel': 'i32', 'XBLOCK': 'constexpr', 'R0_BLOCK': 'constexpr'}, 'device': DeviceProperties(type='cuda', index=0, multi_processor_count=132, cc=90, major=9, regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048, max_threads_per_block=1024, warp_size=32), 'constants': {}, 'native_matmul': False, 'enable_fp_fusion': True, 'launch_pdl': True, 'disable_ftz': False, 'configs': [{(0,): [['tt.divisibility', 16]], (1,): [['tt.divisibility', 16]], (2,): [['tt.divisibility', 16]], (3,): [['tt.divisibility', 16]], (5,): [['tt.divisibility', 16]]}]},
    inductor_meta={'grid_type': 'Grid1D', 'autotune_hints': set(), 'kernel_name': 'triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_3', 'mutated_arg_names': [], 'optimize_mem': True, 'no_x_dim': False, 'atomic_add_found': False, 'num_load': 5, 'num_store': 1, 'num_reduction': 1, 'backend_hash': '91D1D1166449D9E2EB66EB9770C9E2C3B0FEB787341F27FEB4D3F0338DA50336', 'assert_indirect_indexing': True, 'autotune_local_cache': True, 'autotune_pointwise': True, 'autotune_remote_cache': None, 'force_disable_caches': False, 'dynamic_scale_rblock': True, 'max_autotune': False, 'max_autotune_pointwise': False, 'min_split_scan_rblock': 256, 'spill_threshold': 16, 'store_cubin': False, 'deterministic': False, 'force_filter_reduction_configs': False, 'mix_order_reduction_allow_multi_stages': False, 'are_deterministic_algorithms_enabled': False, 'tiling_scores': {'x': 0, 'r0_': 36864}}
)
@triton.jit
def triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_3(in_ptr0, in_ptr1, in_ptr2, out_ptr1, xnumel, r0_numel, XBLOCK : tl.constexpr, R0_BLOCK : tl.constexpr):
    r0_numel = 2048
    rnumel = r0_numel
    RBLOCK: tl.constexpr = R0_BLOCK
    xoffset = tl.program_id(0) * XBLOCK
    xindex = xoffset + tl.arange(0, XBLOCK)[:, None]
    xmask = xindex < xnumel
    r0_base = tl.arange(0, R0_BLOCK)[None, :]
    rbase = r0_base
    x0 = xindex
    tl.extra.cuda.gdc_wait()
    _tmp6 = tl.full([XBLOCK, R0_BLOCK], 0, tl.float32)
    for r0_offset in tl.range(0, r0_numel, R0_BLOCK):
        r0_index = r0_offset + r0_base
        r0_mask = r0_index < r0_numel
        roffset = r0_offset
        rindex = r0_index
        r0_1 = r0_index
        tmp0 = tl.load(in_ptr0 + (r0_1 + 2048*x0), r0_mask & xmask, eviction_policy='evict_last', other=0.0).to(tl.float32)
        tmp1 = tl.load(in_ptr1 + (r0_1 + 2048*x0), r0_mask & xmask, eviction_policy='evict_last', other=0.0).to(tl.float32)
        tmp2 = tmp0 + tmp1
        tmp3 = tmp2.to(tl.float32)
        tmp4 = tmp3 * tmp3
        tmp5 = tl.broadcast_to(tmp4, [XBLOCK, R0_BLOCK])
        tmp7 = _tmp6 + tmp5
        _tmp6 = tl.where(r0_mask & xmask, tmp7, _tmp6)
    tmp6 = tl.sum(_tmp6, 1)[:, None]
    for r0_offset in tl.range(0, r0_numel, R0_BLOCK):
        r0_index = r0_offset + r0_base
        r0_mask = r0_index < r0_numel
        roffset = r0_offset
        rindex = r0_index
        r0_1 = r0_index
        tmp8 = tl.load(in_ptr0 + (r0_1 + 2048*x0), r0_mask & xmask, eviction_policy='evict_first', other=0.0).to(tl.float32)
        tmp9 = tl.load(in_ptr1 + (r0_1 + 2048*x0), r0_mask & xmask, eviction_policy='evict_first', other=0.0).to(tl.float32)
        tmp18 = tl.load(in_ptr2 + (r0_1), r0_mask, eviction_policy='evict_last', other=0.0).to(tl.float32)
        tmp10 = tmp8 + tmp9
        tmp11 = tmp10.to(tl.float32)
        tmp12 = tl.full([1, 1], 2048.0, tl.float32)
        tmp13 = (tmp6 / tmp12)
        tmp14 = tl.full([1, 1], 1e-06, tl.float32)
        tmp15 = tmp13 + tmp14
        tmp16 = libdevice.rsqrt(tmp15)
        tmp17 = tmp11 * tmp16
        tmp19 = tmp18.to(tl.float32)
        tmp20 = tl.full([1, 1], 1.0, tl.float32)
        tmp21 = tmp19 + tmp20
        tmp22 = tmp17 * tmp21
        tmp23 = tmp22.to(tl.float32)
        tl.store(out_ptr1 + (r0_1 + 2048*x0), tmp23, r0_mask & xmask)
    tl.extra.cuda.gdc_launch_dependents()
''', device_str='cuda')


# kernel path: /tmp/ind_c1/ei/ceihufepunkik33u7b3sdf67q3cnjmxtn37obunwaecqoate7xql.py
# Topologically Sorted Source Nodes: [add_3, reshape_3, add_6], Original ATen: [aten.add, aten.view]
# Source node to ATen node mapping:
#   add_3 => add_128
#   add_6 => add_173
#   reshape_3 => view_6
# Graph fragment:
#   %arg1_1 : Tensor "bf16[1, s27, 2048][2048*s27, 2048, 1]cuda:0" = PlaceHolder[target=arg1_1]
#   %linear_fp8 : Tensor "bf16[1, s27, 2048][2048*s27, 2048, 1]cuda:0" = PlaceHolder[target=linear_fp8]
#   %moe_experts : Tensor "bf16[s27, 2048][2048, 1]cuda:0" = PlaceHolder[target=moe_experts]
#   %add_128 : Tensor "bf16[1, s27, 2048][2048*s27, 2048, 1]cuda:0"[num_users=2] = call_function[target=torch.ops.aten.add.Tensor](args = (%arg1_1, %linear_fp8), kwargs = {})
#   %view_6 : Tensor "bf16[1, s27, 2048][2048*s27, 2048, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.reshape.default](args = (%moe_experts, [1, %arg0_1, 2048]), kwargs = {})
#   %add_173 : Tensor "bf16[1, s27, 2048][2048*s27, 2048, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.add.Tensor](args = (%add_128, %view_6), kwargs = {})
#   return %add_173
triton_poi_fused_add_view_4 = async_compile.triton('triton_poi_fused_add_view_4', '''
import triton
import triton.language as tl

from torch._inductor.runtime import triton_helpers, triton_heuristics
from torch._inductor.runtime.triton_helpers import libdevice, math as tl_math
from torch._inductor.runtime.hints import AutotuneHint, ReductionHint, TileHint, DeviceProperties
triton_helpers.set_driver_to_gpu()

@triton_heuristics.pointwise(
    size_hints={'x': 4096}, 
    filename=__file__,
    triton_meta={'signature': {'in_out_ptr0': '*bf16', 'in_ptr0': '*bf16', 'in_ptr1': '*bf16', 'xnumel': 'i32', 'XBLOCK': 'constexpr'}, 'device': DeviceProperties(type='cuda', index=0, multi_processor_count=132, cc=90, major=9, regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048, max_threads_per_block=1024, warp_size=32), 'constants': {}, 'native_matmul': False, 'enable_fp_fusion': True, 'launch_pdl': True, 'disable_ftz': False, 'configs': [{(0,): [['tt.divisibility', 16]], (1,): [['tt.divisibility', 16]], (2,): [['tt.divisibility', 16]], (3,): [['tt.divisibility', 16]]}]},
    inductor_meta={'grid_type': 'Grid1D', 'autotune_hints': set(), 'kernel_name': 'triton_poi_fused_add_view_4', 'mutated_arg_names': ['in_out_ptr0'], 'optimize_mem': True, 'no_x_dim': False, 'atomic_add_found': False, 'num_load': 3, 'num_store': 1, 'num_reduction': 0, 'backend_hash': '91D1D1166449D9E2EB66EB9770C9E2C3B0FEB787341F27FEB4D3F0338DA50336', 'assert_indirect_indexing': True, 'autotune_local_cache': True, 'autotune_pointwise': True, 'autotune_remote_cache': None, 'force_disable_caches': False, 'dynamic_scale_rblock': True, 'max_autotune': False, 'max_autotune_pointwise': False, 'min_split_scan_rblock': 256, 'spill_threshold': 16, 'store_cubin': False, 'deterministic': False, 'force_filter_reduction_configs': False, 'mix_order_reduction_allow_multi_stages': False, 'are_deterministic_algorithms_enabled': False, 'tiling_scores': {'x': 40960}},
    min_elem_per_thread=0
)
@triton.jit
def triton_poi_fused_add_view_4(in_out_ptr0, in_ptr0, in_ptr1, xnumel, XBLOCK : tl.constexpr):
    xoffset = tl.program_id(0) * XBLOCK
    xindex = xoffset + tl.arange(0, XBLOCK)[:]
    xmask = xindex < xnumel
    x0 = xindex
    tl.extra.cuda.gdc_wait()
    tmp0 = tl.load(in_ptr0 + (x0), xmask).to(tl.float32)
    tmp1 = tl.load(in_out_ptr0 + (x0), xmask).to(tl.float32)
    tmp3 = tl.load(in_ptr1 + (x0), xmask).to(tl.float32)
    tl.extra.cuda.gdc_launch_dependents()
    tmp2 = tmp0 + tmp1
    tmp4 = tmp2 + tmp3
    tl.store(in_out_ptr0 + (x0), tmp4, xmask)
''', device_str='cuda')


async_compile.wait(globals())
del async_compile

class Runner:
    def __init__(self, partitions):
        self.partitions = partitions

    def recursively_apply_fns(self, fns):
        new_callables = []
        for fn, c in zip(fns, self.partitions):
            new_callables.append(fn(c))
        self.partitions = new_callables

    def call(self, args):
        arg0_1, arg1_1, arg2_1, arg3_1, arg4_1, arg5_1, arg6_1, arg7_1, arg8_1, arg9_1, arg10_1, arg11_1, arg12_1, arg13_1, arg14_1, arg15_1, arg16_1, arg17_1, arg18_1, arg19_1, arg20_1 = args
        args.clear()
        s27 = arg0_1
        s96 = arg3_1
        assert_size_stride(arg1_1, (1, s27, 2048), (2048*s27, 2048, 1))
        assert_size_stride(arg2_1, (2048, ), (1, ))
        assert_size_stride(arg4_1, (1, s96, 32, 257), (8224*s96, 8224, 257, 1))
        assert_size_stride(arg5_1, (8192, 1, 4), (4, 4, 1))
        assert_size_stride(arg6_1, (12352, 2048), (2048, 1))
        assert_size_stride(arg7_1, (9, 8192, 3), (24576, 3, 1))
        assert_size_stride(arg8_1, (1, ), (1, ))
        assert_size_stride(arg9_1, (32, ), (1, ))
        assert_size_stride(arg10_1, (32, ), (1, ))
        assert_size_stride(arg11_1, (9, 32, 128, 128), (524288, 16384, 128, 1))
        assert_size_stride(arg12_1, (128, ), (1, ))
        assert_size_stride(arg13_1, (2048, 4096), (4096, 1))
        assert_size_stride(arg14_1, (16, 32), (32, 1))
        assert_size_stride(arg15_1, (2048, ), (1, ))
        assert_size_stride(arg16_1, (520, 2048), (2048, 1))
        assert_size_stride(arg17_1, (513, 1024, 2048), (2097152, 2048, 1))
        assert_size_stride(arg18_1, (513, 2048, 512), (1048576, 512, 1))
        assert_size_stride(arg19_1, (513, 8, 16), (128, 16, 1))
        assert_size_stride(arg20_1, (513, 16, 4), (64, 4, 1))
        with torch.cuda._DeviceGuard(0):
            torch.cuda.set_device(0)
            buf1 = empty_strided_cuda((1, s27, 2048), (2048*s27, 2048, 1), torch.bfloat16)
            # Topologically Sorted Source Nodes: [xf, pow_1, mean, add, rsqrt, xf_1, float_2, add_1, mul_1, to], Original ATen: [aten._to_copy, aten.pow, aten.mean, aten.add, aten.rsqrt, aten.mul]
            stream0 = get_raw_stream(0)
            triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0.run(arg1_1, arg2_1, buf1, s27, 2048, stream=stream0)
            del arg2_1
            buf2 = empty_strided_cuda((s27, 12352), (12352, 1), torch.bfloat16)
            # Topologically Sorted Source Nodes: [xf, pow_1, mean, add, rsqrt, xf_1, float_2, add_1, mul_1, to, linear], Original ATen: [aten._to_copy, aten.pow, aten.mean, aten.add, aten.rsqrt, aten.mul, aten.view, aten.t, aten.mm]
            extern_kernels.mm(reinterpret_tensor(buf1, (s27, 2048), (2048, 1), 0), reinterpret_tensor(arg6_1, (2048, 12352), (1, 2048), 0), out=buf2)
            del arg6_1
            del buf1
            # Topologically Sorted Source Nodes: [linear, split, weight, causal_conv_window_qkvz], Original ATen: [aten._unsafe_view, aten.split_with_sizes, aten.select, strata.causal_conv_window_qkvz]
            buf3 = torch.ops.strata.causal_conv_window_qkvz.default(reinterpret_tensor(buf2, (1, s27, 12288), (12352*s27, 12352, 1), 0), arg7_1, reinterpret_tensor(arg5_1, (8192, 4), (4, 1), 0), arg8_1, 16, 128, 256)
            del arg5_1
            del arg7_1
            buf4 = buf3[0]
            assert_size_stride(buf4, (1, s27, 8192), (8192*s27, 8192, 1), 'torch.ops.strata.causal_conv_window_qkvz.default')
            assert_alignment(buf4, 16, 'torch.ops.strata.causal_conv_window_qkvz.default')
            buf5 = buf3[1]
            assert_size_stride(buf5, (1, s27, 8192, 3), (24576*s27, 24576, 3, 1), 'torch.ops.strata.causal_conv_window_qkvz.default')
            assert_alignment(buf5, 16, 'torch.ops.strata.causal_conv_window_qkvz.default')
            del buf3
            # Topologically Sorted Source Nodes: [linear, split, core], Original ATen: [aten._unsafe_view, aten.split_with_sizes, strata.gated_delta_window_prep_factors_into]
            buf6 = torch.ops.strata.gated_delta_window_prep_factors_into.default(buf4, reinterpret_tensor(buf2, (1, s27, 64), (12352*s27, 12352, 1), 12288), arg9_1, arg10_1, arg11_1, arg8_1, 16, 128, 0.08838834764831845, 1e-06, arg4_1)
            del arg10_1
            del arg11_1
            del arg4_1
            del arg8_1
            del arg9_1
            del buf4
            buf8 = buf6
            assert_size_stride(buf8, (1, s27, 32, 128), (4096*s27, 4096, 128, 1), 'torch.ops.strata.gated_delta_window_prep_factors_into.default')
            assert_alignment(buf8, 16, 'torch.ops.strata.gated_delta_window_prep_factors_into.default')
            del buf6
            buf9 = empty_strided_cuda((1, s27, 32, 1), (32*s27, 32, 1, 32*s27), torch.float32)
            # Topologically Sorted Source Nodes: [pow_2, mean_1], Original ATen: [aten.pow, aten.mean]
            triton_per_fused_mean_pow_1_xnumel = 32*s27
            stream0 = get_raw_stream(0)
            triton_per_fused_mean_pow_1.run(buf8, buf9, triton_per_fused_mean_pow_1_xnumel, 128, stream=stream0)
            buf10 = empty_strided_cuda((1, s27, 4096), (4096*s27, 4096, 1), torch.bfloat16)
            # Topologically Sorted Source Nodes: [linear, split, pow_2, mean_1, add_2, rsqrt_1, xf_3, to_2, out, view, z, z_1, float_4, silu, mul_4, out_1, reshape_1, h], Original ATen: [aten._unsafe_view, aten.split_with_sizes, aten.pow, aten.mean, aten.add, aten.rsqrt, aten.mul, aten._to_copy, aten.view, aten.slice, aten.clone, aten.silu, strata.linear_fp8]
            triton_poi_fused__to_copy__unsafe_view_add_clone_linear_fp8_mean_mul_pow_rsqrt_silu_slice_split_with_sizes_view_2_xnumel = 4096*s27
            stream0 = get_raw_stream(0)
            triton_poi_fused__to_copy__unsafe_view_add_clone_linear_fp8_mean_mul_pow_rsqrt_silu_slice_split_with_sizes_view_2.run(arg12_1, buf8, buf9, buf2, buf10, s27, triton_poi_fused__to_copy__unsafe_view_add_clone_linear_fp8_mean_mul_pow_rsqrt_silu_slice_split_with_sizes_view_2_xnumel, stream=stream0)
            del arg12_1
            del buf2
            del buf8
            del buf9
            # Topologically Sorted Source Nodes: [linear, split, pow_2, mean_1, add_2, rsqrt_1, xf_3, to_2, out, view, z, z_1, float_4, silu, mul_4, out_1, reshape_1, h], Original ATen: [aten._unsafe_view, aten.split_with_sizes, aten.pow, aten.mean, aten.add, aten.rsqrt, aten.mul, aten._to_copy, aten.view, aten.slice, aten.clone, aten.silu, strata.linear_fp8]
            buf11 = torch.ops.strata.linear_fp8.default(buf10, arg13_1, arg14_1, [128, 128])
            del arg13_1
            del arg14_1
            del buf10
            buf12 = buf11
            assert_size_stride(buf12, (1, s27, 2048), (2048*s27, 2048, 1), 'torch.ops.strata.linear_fp8.default')
            assert_alignment(buf12, 16, 'torch.ops.strata.linear_fp8.default')
            del buf11
            buf14 = empty_strided_cuda((1, s27, 2048), (2048*s27, 2048, 1), torch.bfloat16)
            # Topologically Sorted Source Nodes: [add_3, xf_4, pow_3, mean_2, add_4, rsqrt_2, xf_5, float_6, add_5, mul_6, to_4], Original ATen: [aten.add, aten._to_copy, aten.pow, aten.mean, aten.rsqrt, aten.mul]
            stream0 = get_raw_stream(0)
            triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_3.run(arg1_1, buf12, arg15_1, buf14, s27, 2048, stream=stream0)
            del arg15_1
            # Topologically Sorted Source Nodes: [add_3, xf_4, pow_3, mean_2, add_4, rsqrt_2, xf_5, float_6, add_5, mul_6, to_4, x, moe_route], Original ATen: [aten.add, aten._to_copy, aten.pow, aten.mean, aten.rsqrt, aten.mul, aten.view, strata.moe_route]
            buf15 = torch.ops.strata.moe_route.default(reinterpret_tensor(buf14, (s27, 2048), (2048, 1), 0), arg16_1, 512, 10, True, None, 512)
            del arg16_1
            buf16 = buf15[0]
            assert_size_stride(buf16, (s27, 11), (11, 1), 'torch.ops.strata.moe_route.default')
            assert_alignment(buf16, 16, 'torch.ops.strata.moe_route.default')
            buf17 = buf15[1]
            assert_size_stride(buf17, (s27, 11), (11, 1), 'torch.ops.strata.moe_route.default')
            assert_alignment(buf17, 16, 'torch.ops.strata.moe_route.default')
            del buf15
            # Topologically Sorted Source Nodes: [add_3, xf_4, pow_3, mean_2, add_4, rsqrt_2, xf_5, float_6, add_5, mul_6, to_4, x, moe_experts], Original ATen: [aten.add, aten._to_copy, aten.pow, aten.mean, aten.rsqrt, aten.mul, aten.view, strata.moe_experts]
            buf18 = torch.ops.strata.moe_experts.default(reinterpret_tensor(buf14, (s27, 2048), (2048, 1), 0), arg17_1, arg18_1, buf16, buf17, arg19_1, arg20_1, [128, 128], slot_of=None, host_gate_up=None, host_down=None, host_gu_scale=None, host_down_scale=None, prompt=False)
            del arg17_1
            del arg18_1
            del arg19_1
            del arg20_1
            del buf14
            del buf16
            del buf17
            buf19 = buf18
            assert_size_stride(buf19, (s27, 2048), (2048, 1), 'torch.ops.strata.moe_experts.default')
            assert_alignment(buf19, 16, 'torch.ops.strata.moe_experts.default')
            del buf18
            buf20 = buf12; del buf12  # reuse
            # Topologically Sorted Source Nodes: [add_3, reshape_3, add_6], Original ATen: [aten.add, aten.view]
            triton_poi_fused_add_view_4_xnumel = 2048*s27
            stream0 = get_raw_stream(0)
            triton_poi_fused_add_view_4.run(buf20, arg1_1, buf19, triton_poi_fused_add_view_4_xnumel, stream=stream0)
            del arg1_1
            del buf19
        return (buf20, buf5, )

runner = Runner(partitions=[])
call = runner.call
recursively_apply_fns = runner.recursively_apply_fns


def get_args():
    from torch._dynamo.testing import rand_strided
    arg0_1 = 2
    arg1_1 = rand_strided((1, 2, 2048), (4096, 2048, 1), device='cuda:0', dtype=torch.bfloat16)
    arg2_1 = rand_strided((2048, ), (1, ), device='cuda:0', dtype=torch.bfloat16)
    arg3_1 = 2
    arg4_1 = rand_strided((1, 2, 32, 257), (16448, 8224, 257, 1), device='cuda:0', dtype=torch.float32)
    arg5_1 = rand_strided((8192, 1, 4), (4, 4, 1), device='cuda:0', dtype=torch.bfloat16)
    arg6_1 = rand_strided((12352, 2048), (2048, 1), device='cuda:0', dtype=torch.bfloat16)
    arg7_1 = rand_strided((9, 8192, 3), (24576, 3, 1), device='cuda:0', dtype=torch.bfloat16)
    arg8_1 = rand_strided((1, ), (1, ), device='cuda:0', dtype=torch.int64)
    arg9_1 = rand_strided((32, ), (1, ), device='cuda:0', dtype=torch.float32)
    arg10_1 = rand_strided((32, ), (1, ), device='cuda:0', dtype=torch.float32)
    arg11_1 = rand_strided((9, 32, 128, 128), (524288, 16384, 128, 1), device='cuda:0', dtype=torch.float32)
    arg12_1 = rand_strided((128, ), (1, ), device='cuda:0', dtype=torch.bfloat16)
    arg13_1 = rand_strided((2048, 4096), (4096, 1), device='cuda:0', dtype=torch.float8_e4m3fn)
    arg14_1 = rand_strided((16, 32), (32, 1), device='cuda:0', dtype=torch.float32)
    arg15_1 = rand_strided((2048, ), (1, ), device='cuda:0', dtype=torch.bfloat16)
    arg16_1 = rand_strided((520, 2048), (2048, 1), device='cuda:0', dtype=torch.bfloat16)
    arg17_1 = rand_strided((513, 1024, 2048), (2097152, 2048, 1), device='cuda:0', dtype=torch.float8_e4m3fn)
    arg18_1 = rand_strided((513, 2048, 512), (1048576, 512, 1), device='cuda:0', dtype=torch.float8_e4m3fn)
    arg19_1 = rand_strided((513, 8, 16), (128, 16, 1), device='cuda:0', dtype=torch.float32)
    arg20_1 = rand_strided((513, 16, 4), (64, 4, 1), device='cuda:0', dtype=torch.float32)
    return [arg0_1, arg1_1, arg2_1, arg3_1, arg4_1, arg5_1, arg6_1, arg7_1, arg8_1, arg9_1, arg10_1, arg11_1, arg12_1, arg13_1, arg14_1, arg15_1, arg16_1, arg17_1, arg18_1, arg19_1, arg20_1]


def benchmark_compiled_module(args, times=10, repeat=10):
    from torch._inductor.utils import print_performance
    fn = lambda: call(list(args))
    return print_performance(fn, times=times, repeat=repeat)


if __name__ == "__main__":
    from torch._inductor.wrapper_benchmark import compiled_module_main
    args = get_args()
    compiled_module_main('None', lambda times, repeat: benchmark_compiled_module(args, times=times, repeat=repeat))
