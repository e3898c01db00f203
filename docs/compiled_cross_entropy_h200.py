Output code: 
# AOT ID: ['0_forward']
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


# kernel path: /tmp/torchinductor_root/om/comyhdavjo7nfh56ya5qgp7otgt4hzq5nuqbefrsatu5hd4an4xo.py
# Topologically Sorted Source Nodes: [cross_entropy], Original ATen: [aten._log_softmax, prims.prepare_softmax_online, aten.sub, aten.nll_loss_forward]
# Source node to ATen node mapping:
#   cross_entropy => convert_element_type, convert_element_type_1, full_default, full_default_1, gather, log, ne, neg, squeeze, sub_1, unsqueeze, where, where_1
# Graph fragment:
#   %primals_1 : Tensor "bf16[4096, 32000][32000, 1]cuda:0" = PlaceHolder[target=primals_1]
#   %getitem_1 : Tensor "f32[4096, 1][1, 4096]cuda:0" = PlaceHolder[target=getitem_1]
#   %primals_2 : Tensor "i64[4096][1]cuda:0" = PlaceHolder[target=primals_2]
#   %getitem : Tensor "f32[4096, 1][1, 1]cuda:0" = PlaceHolder[target=getitem]
#   %log : Tensor "f32[4096, 1][1, 1]cuda:0" = PlaceHolder[target=log]
#   %convert_element_type : Tensor "f32[4096, 32000][32000, 1]cuda:0"[num_users=2] = call_function[target=torch.ops.prims.convert_element_type.default](args = (%primals_1, torch.float32), kwargs = {})
#   %prepare_softmax_online_default : [num_users=2] = call_function[target=torch.ops.prims.prepare_softmax_online.default](args = (%convert_element_type, 1), kwargs = {})
#   %sub_tensor : Tensor "f32[4096, 32000][32000, 1]cuda:0"[num_users=2] = call_function[target=torch.ops.aten.sub.Tensor](args = (%convert_element_type, %getitem), kwargs = {})
#   %log : Tensor "f32[4096, 1][1, 1]cuda:0"[num_users=2] = call_function[target=torch.ops.aten.log.default](args = (%getitem_1,), kwargs = {})
#   %sub_1 : Tensor "f32[4096, 32000][32000, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.sub.Tensor](args = (%sub_tensor, %log), kwargs = {})
#   %convert_element_type_1 : Tensor "bf16[4096, 32000][32000, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.prims.convert_element_type.default](args = (%sub_1, torch.bfloat16), kwargs = {})
#   %ne : Tensor "b8[4096][1]cuda:0"[num_users=2] = call_function[target=torch.ops.aten.ne.Scalar](args = (%primals_2, -100), kwargs = {})
#   %full_default : Tensor "i64[][]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.full.default](args = ([], 0), kwargs = {dtype: torch.int64, layout: torch.strided, device: cuda:0, pin_memory: False})
#   %where : Tensor "i64[4096][1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.where.self](args = (%ne, %primals_2, %full_default), kwargs = {})
#   %unsqueeze : Tensor "i64[4096, 1][1, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.unsqueeze.default](args = (%where, 1), kwargs = {})
#   %gather : Tensor "bf16[4096, 1][1, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.gather.default](args = (%convert_element_type_1, 1, %unsqueeze), kwargs = {})
#   %squeeze : Tensor "bf16[4096][1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.squeeze.dim](args = (%gather, 1), kwargs = {})
#   %neg : Tensor "bf16[4096][1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.neg.default](args = (%squeeze,), kwargs = {})
#   %full_default_1 : Tensor "bf16[][]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.full.default](args = ([], 0.0), kwargs = {dtype: torch.bfloat16, layout: torch.strided, device: cuda:0, pin_memory: False})
#   %where_1 : Tensor "bf16[4096][1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.where.self](args = (%ne, %neg, %full_default_1), kwargs = {})
#   return %getitem,%getitem_1,%log,%where_1
triton_red_fused__log_softmax_nll_loss_forward_prepare_softmax_online_sub_0 = async_compile.triton('triton_red_fused__log_softmax_nll_loss_forward_prepare_softmax_online_sub_0', '''
import triton
import triton.language as tl

from torch._inductor.runtime import triton_helpers, triton_heuristics
from torch._inductor.runtime.triton_helpers import libdevice, math as tl_math
from torch._inductor.runtime.hints import AutotuneHint, ReductionHint, TileHint, DeviceProperties
triton_helpers.set_driver_to_gpu()

@triton_heuristics.reduction(
    size_hints={'x': 4096, 'r0_': 32768},
    reduction_hint=ReductionHint.INNER,
    filename=__file__,
    triton_meta={'signature': {'in_out_ptr0': '*fp32', 'in_ptr0': '*bf16', 'in_ptr1': '*i64', 'out_ptr0': '*fp32', 'out_ptr1': '*bf16', 'xnumel': 'i32', 'r0_numel': 'i32', 'XBLOCK': 'constexpr', 'R0_BLOCK': 'constexpr'}, 'device': DeviceProperties(type='cuda', index=0, multi_processor_count=132, cc=90, major=9, regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048, max_threads_per_block=1024, warp_size=32), 'constants': {}, 'native_matmul': False, 'enable_fp_fusion': True, 'launch_pdl': False, 'disable_ftz': False, 'configs': [{(0,): [['tt.divisibility', 16]], (1,): [['tt.divisibility', 16]], (2,): [['tt.divisibility', 16]], (3,): [['tt.divisibility', 16]], (4,): [['tt.divisibility', 16]], (5,): [['tt.divisibility', 16]], (6,): [['tt.divisibility', 16]]}]},
    inductor_meta={'grid_type': 'Grid1D', 'autotune_hints': set(), 'kernel_name': 'triton_red_fused__log_softmax_nll_loss_forward_prepare_softmax_online_sub_0', 'mutated_arg_names': ['in_out_ptr0'], 'optimize_mem': False, 'no_x_dim': False, 'atomic_add_found': False, 'num_load': 2, 'num_store': 3, 'num_reduction': 2, 'backend_hash': '91D1D1166449D9E2EB66EB9770C9E2C3B0FEB787341F27FEB4D3F0338DA50336', 'assert_indirect_indexing': True, 'autotune_local_cache': True, 'autotune_pointwise': True, 'autotune_remote_cache': None, 'force_disable_caches': False, 'dynamic_scale_rblock': True, 'max_autotune': False, 'max_autotune_pointwise': False, 'min_split_scan_rblock': 256, 'spill_threshold': 16, 'store_cubin': False, 'deterministic': False, 'force_filter_reduction_configs': False, 'mix_order_reduction_allow_multi_stages': False, 'are_deterministic_algorithms_enabled': False, 'add_persistent_rblock': True, 'tiling_scores': {'x': 114688, 'r0_': 262144000}}
)
@triton.jit
def triton_red_fused__log_softmax_nll_loss_forward_prepare_softmax_online_sub_0(in_out_ptr0, in_ptr0, in_ptr1, out_ptr0, out_ptr1, xnumel, r0_numel, XBLOCK : tl.constexpr, R0_BLOCK : tl.constexpr):
    xnumel = 4096
    r0_numel = 32000
    rnumel = r0_numel
    RBLOCK: tl.constexpr = R0_BLOCK
    xoffset = tl.program_id(0) * XBLOCK
    xindex = xoffset + tl.arange(0, XBLOCK)[:, None]
    xmask = tl.full([XBLOCK], True, tl.int1)[:, None]
    r0_base = tl.arange(0, R0_BLOCK)[None, :]
    rbase = r0_base
    x0 = xindex
    _tmp3_max = tl.full([XBLOCK, R0_BLOCK], float('-inf'), tl.float32)
    _tmp3_sum = tl.zeros([XBLOCK, R0_BLOCK], tl.float32)
    for r0_offset in tl.range(0, r0_numel, R0_BLOCK):
        r0_index = r0_offset + r0_base
        r0_mask = r0_index < r0_numel
        roffset = r0_offset
        rindex = r0_index
        r0_1 = r0_index
        tmp0 = tl.load(in_ptr0 + (r0_1 + 32000*x0), r0_mask, eviction_policy='evict_last', other=0.0).to(tl.float32)
        tmp1 = tmp0.to(tl.float32)
        tmp2 = tl.broadcast_to(tmp1, [XBLOCK, R0_BLOCK])

        _tmp3_max_next, _tmp3_sum_next = triton_helpers.online_softmax_combine(
            _tmp3_max, _tmp3_sum, tmp2, False
        )

        _tmp3_max = tl.where(r0_mask, _tmp3_max_next, _tmp3_max)
        _tmp3_sum = tl.where(r0_mask, _tmp3_sum_next, _tmp3_sum)

    tmp3, tmp4 = triton_helpers.online_softmax_reduce(
        _tmp3_max, _tmp3_sum, 1, False)
    tmp3 = tmp3[:, None]
    tmp4 = tmp4[:, None]
    tl.store(out_ptr0 + (x0), tmp3, None)
    tmp6 = tl.load(in_ptr1 + (x0), None, eviction_policy='evict_last')
    tmp5 = tl_math.log(tmp4)
    tmp7 = tl.full([1, 1], -100, tl.int64)
    tmp8 = tmp6 != tmp7
    tmp9 = tl.full([1, 1], 0, tl.int64)
    tmp10 = tl.where(tmp8, tmp6, tmp9)
    tmp11 = tl.full([1, 1], 32000, tl.int32)
    tmp12 = tmp10 + tmp11
    tmp13 = tmp10 < 0
    tmp14 = tl.where(tmp13, tmp12, tmp10)
    tl.device_assert((0 <= tmp14) & (tmp14 < 32000), "index out of bounds: 0 <= tmp14 < 32000")
    tmp16 = tl.load(in_ptr0 + (tmp14 + 32000*x0), None, eviction_policy='evict_last').to(tl.float32)
    tmp17 = tmp16.to(tl.float32)
    tmp18 = tmp17 - tmp3
    tmp19 = tmp18 - tmp5
    tmp20 = tmp19.to(tl.float32)
    tmp21 = -tmp20
    tmp22 = tl.full([1, 1], 0.0, tl.float32)
    tmp23 = tl.where(tmp8, tmp21, tmp22)
    tl.debug_barrier()
    tl.store(in_out_ptr0 + (x0), tmp5, None)
    tl.store(out_ptr1 + (x0), tmp23, None)
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
        primals_1, primals_2 = args
        args.clear()
        assert_size_stride(primals_1, (4096, 32000), (32000, 1))
        assert_size_stride(primals_2, (4096, ), (1, ))
        with torch.cuda._DeviceGuard(0):
            torch.cuda.set_device(0)
            buf0 = empty_strided_cuda((4096, 1), (1, 1), torch.float32)
            buf1 = empty_strided_cuda((4096, 1), (1, 4096), torch.float32)
            buf2 = reinterpret_tensor(buf1, (4096, 1), (1, 1), 0); del buf1  # reuse
            buf3 = empty_strided_cuda((4096, ), (1, ), torch.bfloat16)
            # Topologically Sorted Source Nodes: [cross_entropy], Original ATen: [aten._log_softmax, prims.prepare_softmax_online, aten.sub, aten.nll_loss_forward]
            stream0 = get_raw_stream(0)
            triton_red_fused__log_softmax_nll_loss_forward_prepare_softmax_online_sub_0.run(buf2, primals_1, primals_2, buf0, buf3, 4096, 32000, stream=stream0)
        return (buf3, primals_1, primals_2, buf0, buf2, )

runner = Runner(partitions=[])
call = runner.call
recursively_apply_fns = runner.recursively_apply_fns


def get_args():
    from torch._dynamo.testing import rand_strided
    primals_1 = rand_strided((4096, 32000), (32000, 1), device='cuda:0', dtype=torch.bfloat16)
    primals_2 = rand_strided((4096, ), (1, ), device='cuda:0', dtype=torch.int64)
    return [primals_1, primals_2]


def benchmark_compiled_module(args, times=10, repeat=10):
    from torch._inductor.utils import print_performance
    fn = lambda: call(list(args))
    return print_performance(fn, times=times, repeat=repeat)


if __name__ == "__main__":
    from torch._inductor.wrapper_benchmark import compiled_module_main
    args = get_args()
    compiled_module_main('None', lambda times, repeat: benchmark_compiled_module(args, times=times, repeat=repeat))


Output code: 
# AOT ID: ['0_backward']
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


# kernel path: /tmp/torchinductor_root/as/cas57ordvakkj2v4pqvn3rol3qliu4kdshgfvdjtczppozc5pdoe.py
# Topologically Sorted Source Nodes: [unsqueeze_2, cross_entropy, unsqueeze_1, ne_2, where_3, where_2, mul, convert_element_type_3, exp_1, sum_2, mul_1, sub_2, convert_element_type_4], Original ATen: [aten.nll_loss_backward, aten.nll_loss_forward, aten.arange, aten.view, aten.expand, aten.eq, aten.scalar_tensor, aten.where, aten._log_softmax, aten._log_softmax_backward_data]
# Source node to ATen node mapping:
#   convert_element_type_3 => convert_element_type_3
#   convert_element_type_4 => convert_element_type_4
#   cross_entropy => convert_element_type, convert_element_type_1, full_default, full_default_1, sub, sub_1
#   exp_1 => exp_1
#   mul => mul
#   mul_1 => mul_1
#   ne_2 => ne_2
#   sub_2 => sub_2
#   sum_2 => sum_2
#   unsqueeze_1 => unsqueeze_1
#   unsqueeze_2 => unsqueeze_2
#   where_2 => where_2
#   where_3 => where_3
# Graph fragment:
#   %primals_2 : Tensor "i64[4096][1]cuda:0" = PlaceHolder[target=primals_2]
#   %tangents_1 : Tensor "bf16[4096][1]cuda:0" = PlaceHolder[target=tangents_1]
#   %primals_1 : Tensor "bf16[4096, 32000][32000, 1]cuda:0" = PlaceHolder[target=primals_1]
#   %amax : Tensor "f32[4096, 1][1, 1]cuda:0" = PlaceHolder[target=amax]
#   %log : Tensor "f32[4096, 1][1, 1]cuda:0" = PlaceHolder[target=log]
#   %sum_2 : Tensor "f32[4096, 1][1, 4096]cuda:0" = PlaceHolder[target=sum_2]
#   %unsqueeze_2 : Tensor "bf16[4096, 1][1, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.unsqueeze.default](args = (%tangents_1, 1), kwargs = {})
#   %full_default_1 : Tensor "bf16[][]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.full.default](args = ([], 0.0), kwargs = {dtype: torch.bfloat16, layout: torch.strided, device: cuda:0, pin_memory: False})
#   %unsqueeze_1 : Tensor "i64[4096, 1][1, 1]cuda:0"[num_users=2] = call_function[target=torch.ops.aten.unsqueeze.default](args = (%primals_2, 1), kwargs = {})
#   %ne_2 : Tensor "b8[4096, 1][1, 1]cuda:0"[num_users=2] = call_function[target=torch.ops.aten.ne.Scalar](args = (%unsqueeze_1, -100), kwargs = {})
#   %where_3 : Tensor "bf16[4096, 1][1, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.where.self](args = (%ne_2, %unsqueeze_2, %full_default_1), kwargs = {})
#   %full_default : Tensor "i64[][]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.full.default](args = ([], 0), kwargs = {dtype: torch.int64, layout: torch.strided, device: cuda:0, pin_memory: False})
#   %where_2 : Tensor "i64[4096, 1][1, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.where.self](args = (%ne_2, %unsqueeze_1, %full_default), kwargs = {})
#   %iota_default : Tensor "i64[32000][1]cuda:0"[num_users=1] = call_function[target=torch.ops.prims.iota.default](args = (32000,), kwargs = {start: 0, step: 1, dtype: torch.int64, device: cuda:0, requires_grad: False})
#   %view_default : Tensor "i64[1, 32000][32000, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.reshape.default](args = (%iota_default, [1, 32000]), kwargs = {})
#   %expand_default : Tensor "i64[4096, 32000][1, 0]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.expand.default](args = (%where_2, [4096, 32000]), kwargs = {})
#   %eq_tensor : Tensor "b8[4096, 32000][32000, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.eq.Tensor](args = (%expand_default, %view_default), kwargs = {})
#   %scalar_tensor_default : Tensor "f32[][]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.scalar_tensor.default](args = (0,), kwargs = {dtype: torch.float32, layout: torch.strided, device: cuda:0})
#   %scalar_tensor_default_1 : Tensor "f32[][]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.scalar_tensor.default](args = (-1.0,), kwargs = {dtype: torch.float32, layout: torch.strided, device: cuda:0})
#   %where_self : Tensor "f32[4096, 32000][32000, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.where.self](args = (%eq_tensor, %scalar_tensor_default_1, %scalar_tensor_default), kwargs = {})
#   %mul : Tensor "f32[4096, 32000][32000, 1]cuda:0"[num_users=2] = call_function[target=torch.ops.aten.mul.Tensor](args = (%where_self, %where_3), kwargs = {})
#   %convert_element_type : Tensor "f32[4096, 32000][32000, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.prims.convert_element_type.default](args = (%primals_1, torch.float32), kwargs = {})
#   %sub : Tensor "f32[4096, 32000][32000, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.sub.Tensor](args = (%convert_element_type, %amax), kwargs = {})
#   %sub_1 : Tensor "f32[4096, 32000][32000, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.sub.Tensor](args = (%sub, %log), kwargs = {})
#   %convert_element_type_1 : Tensor "bf16[4096, 32000][32000, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.prims.convert_element_type.default](args = (%sub_1, torch.bfloat16), kwargs = {})
#   %convert_element_type_3 : Tensor "f32[4096, 32000][32000, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.prims.convert_element_type.default](args = (%convert_element_type_1, torch.float32), kwargs = {})
#   %exp_1 : Tensor "f32[4096, 32000][32000, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.exp.default](args = (%convert_element_type_3,), kwargs = {})
#   %sum_2 : Tensor "f32[4096, 1][1, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.sum.dim_IntList](args = (%mul, [1], True), kwargs = {})
#   %mul_1 : Tensor "f32[4096, 32000][32000, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.mul.Tensor](args = (%exp_1, %sum_2), kwargs = {})
#   %sub_2 : Tensor "f32[4096, 32000][32000, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.aten.sub.Tensor](args = (%mul, %mul_1), kwargs = {})
#   %convert_element_type_4 : Tensor "bf16[4096, 32000][32000, 1]cuda:0"[num_users=1] = call_function[target=torch.ops.prims.convert_element_type.default](args = (%sub_2, torch.bfloat16), kwargs = {})
#   return %sum_2,%convert_element_type_4
triton_red_fused__log_softmax__log_softmax_backward_data_arange_eq_expand_nll_loss_backward_nll_loss_forward_scalar_tensor_view_where_0 = async_compile.triton('triton_red_fused__log_softmax__log_softmax_backward_data_arange_eq_expand_nll_loss_backward_nll_loss_forward_scalar_tensor_view_where_0', '''
import triton
import triton.language as tl

from torch._inductor.runtime import triton_helpers, triton_heuristics
from torch._inductor.runtime.triton_helpers import libdevice, math as tl_math
from torch._inductor.runtime.hints import AutotuneHint, ReductionHint, TileHint, DeviceProperties
triton_helpers.set_driver_to_gpu()

@triton_heuristics.reduction(
    size_hints={'x': 4096, 'r0_': 32768},
    reduction_hint=ReductionHint.INNER,
    filename=__file__,
    triton_meta={'signature': {'in_ptr0': '*i64', 'in_ptr1': '*bf16', 'in_ptr2': '*bf16', 'in_ptr3': '*fp32', 'in_ptr4': '*fp32', 'out_ptr1': '*bf16', 'xnumel': 'i32', 'r0_numel': 'i32', 'XBLOCK': 'constexpr', 'R0_BLOCK': 'constexpr'}, 'device': DeviceProperties(type='cuda', index=0, multi_processor_count=132, cc=90, major=9, regs_per_multiprocessor=65536, max_threads_per_multi_processor=2048, max_threads_per_block=1024, warp_size=32), 'constants': {}, 'native_matmul': False, 'enable_fp_fusion': True, 'launch_pdl': False, 'disable_ftz': False, 'configs': [{(0,): [['tt.divisibility', 16]], (1,): [['tt.divisibility', 16]], (2,): [['tt.divisibility', 16]], (3,): [['tt.divisibility', 16]], (4,): [['tt.divisibility', 16]], (5,): [['tt.divisibility', 16]], (6,): [['tt.divisibility', 16]], (7,): [['tt.divisibility', 16]]}]},
    inductor_meta={'grid_type': 'Grid1D', 'autotune_hints': set(), 'kernel_name': 'triton_red_fused__log_softmax__log_softmax_backward_data_arange_eq_expand_nll_loss_backward_nll_loss_forward_scalar_tensor_view_where_0', 'mutated_arg_names': [], 'optimize_mem': True, 'no_x_dim': False, 'atomic_add_found': False, 'num_load': 5, 'num_store': 1, 'num_reduction': 1, 'backend_hash': '91D1D1166449D9E2EB66EB9770C9E2C3B0FEB787341F27FEB4D3F0338DA50336', 'assert_indirect_indexing': True, 'autotune_local_cache': True, 'autotune_pointwise': True, 'autotune_remote_cache': None, 'force_disable_caches': False, 'dynamic_scale_rblock': True, 'max_autotune': False, 'max_autotune_pointwise': False, 'min_split_scan_rblock': 256, 'spill_threshold': 16, 'store_cubin': False, 'deterministic': False, 'force_filter_reduction_configs': False, 'mix_order_reduction_allow_multi_stages': False, 'are_deterministic_algorithms_enabled': False, 'tiling_scores': {'x': 73728, 'r0_': 786432000}}
)
@triton.jit
def triton_red_fused__log_softmax__log_softmax_backward_data_arange_eq_expand_nll_loss_backward_nll_loss_forward_scalar_tensor_view_where_0(in_ptr0, in_ptr1, in_ptr2, in_ptr3, in_ptr4, out_ptr1, xnumel, r0_numel, XBLOCK : tl.constexpr, R0_BLOCK : tl.constexpr):
    xnumel = 4096
    r0_numel = 32000
    rnumel = r0_numel
    RBLOCK: tl.constexpr = R0_BLOCK
    xoffset = tl.program_id(0) * XBLOCK
    xindex = xoffset + tl.arange(0, XBLOCK)[:, None]
    xmask = tl.full([XBLOCK], True, tl.int1)[:, None]
    r0_base = tl.arange(0, R0_BLOCK)[None, :]
    rbase = r0_base
    x0 = xindex
    tmp0 = tl.load(in_ptr0 + (x0), None, eviction_policy='evict_last')
    tmp10 = tl.load(in_ptr1 + (x0), None, eviction_policy='evict_last').to(tl.float32)
    _tmp15 = tl.full([XBLOCK, R0_BLOCK], 0, tl.float32)
    for r0_offset in tl.range(0, r0_numel, R0_BLOCK):
        r0_index = r0_offset + r0_base
        r0_mask = r0_index < r0_numel
        roffset = r0_offset
        rindex = r0_index
        r0_1 = r0_index
        tmp1 = tl.full([1, 1], -100, tl.int64)
        tmp2 = tmp0 != tmp1
        tmp3 = tl.full([1, 1], 0, tl.int64)
        tmp4 = tl.where(tmp2, tmp0, tmp3)
        tmp5 = r0_1
        tmp6 = tmp4 == tmp5
        tmp7 = tl.full([1, 1], -1.0, tl.float32)
        tmp8 = tl.full([1, 1], 0.0, tl.float32)
        tmp9 = tl.where(tmp6, tmp7, tmp8)
        tmp11 = tl.where(tmp2, tmp10, tmp8)
        tmp12 = tmp11.to(tl.float32)
        tmp13 = tmp9 * tmp12
        tmp14 = tl.broadcast_to(tmp13, [XBLOCK, R0_BLOCK])
        tmp16 = _tmp15 + tmp14
        _tmp15 = tl.where(r0_mask, tmp16, _tmp15)
    tmp15 = tl.sum(_tmp15, 1)[:, None]
    tmp31 = tl.load(in_ptr3 + (x0), None, eviction_policy='evict_last')
    tmp33 = tl.load(in_ptr4 + (x0), None, eviction_policy='evict_last')
    for r0_offset in tl.range(0, r0_numel, R0_BLOCK):
        r0_index = r0_offset + r0_base
        r0_mask = r0_index < r0_numel
        roffset = r0_offset
        rindex = r0_index
        r0_1 = r0_index
        tmp29 = tl.load(in_ptr2 + (r0_1 + 32000*x0), r0_mask, eviction_policy='evict_first', other=0.0).to(tl.float32)
        tmp17 = tl.full([1, 1], -100, tl.int64)
        tmp18 = tmp0 != tmp17
        tmp19 = tl.full([1, 1], 0, tl.int64)
        tmp20 = tl.where(tmp18, tmp0, tmp19)
        tmp21 = r0_1
        tmp22 = tmp20 == tmp21
        tmp23 = tl.full([1, 1], -1.0, tl.float32)
        tmp24 = tl.full([1, 1], 0.0, tl.float32)
        tmp25 = tl.where(tmp22, tmp23, tmp24)
        tmp26 = tl.where(tmp18, tmp10, tmp24)
        tmp27 = tmp26.to(tl.float32)
        tmp28 = tmp25 * tmp27
        tmp30 = tmp29.to(tl.float32)
        tmp32 = tmp30 - tmp31
        tmp34 = tmp32 - tmp33
        tmp35 = tmp34.to(tl.float32)
        tmp36 = tmp35.to(tl.float32)
        tmp37 = libdevice.exp(tmp36)
        tmp38 = tmp37 * tmp15
        tmp39 = tmp28 - tmp38
        tmp40 = tmp39.to(tl.float32)
        tl.store(out_ptr1 + (r0_1 + 32000*x0), tmp40, r0_mask)
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
        primals_1, primals_2, amax, log, tangents_1 = args
        args.clear()
        assert_size_stride(primals_1, (4096, 32000), (32000, 1))
        assert_size_stride(primals_2, (4096, ), (1, ))
        assert_size_stride(amax, (4096, 1), (1, 1))
        assert_size_stride(log, (4096, 1), (1, 1))
        assert_size_stride(tangents_1, (4096, ), (1, ))
        with torch.cuda._DeviceGuard(0):
            torch.cuda.set_device(0)
            buf1 = empty_strided_cuda((4096, 32000), (32000, 1), torch.bfloat16)
            # Topologically Sorted Source Nodes: [unsqueeze_2, cross_entropy, unsqueeze_1, ne_2, where_3, where_2, mul, convert_element_type_3, exp_1, sum_2, mul_1, sub_2, convert_element_type_4], Original ATen: [aten.nll_loss_backward, aten.nll_loss_forward, aten.arange, aten.view, aten.expand, aten.eq, aten.scalar_tensor, aten.where, aten._log_softmax, aten._log_softmax_backward_data]
            stream0 = get_raw_stream(0)
            triton_red_fused__log_softmax__log_softmax_backward_data_arange_eq_expand_nll_loss_backward_nll_loss_forward_scalar_tensor_view_where_0.run(primals_2, tangents_1, primals_1, amax, log, buf1, 4096, 32000, stream=stream0)
            del amax
            del log
            del primals_1
            del primals_2
            del tangents_1
        return (buf1, None, )

runner = Runner(partitions=[])
call = runner.call
recursively_apply_fns = runner.recursively_apply_fns


def get_args():
    from torch._dynamo.testing import rand_strided
    primals_1 = rand_strided((4096, 32000), (32000, 1), device='cuda:0', dtype=torch.bfloat16)
    primals_2 = rand_strided((4096, ), (1, ), device='cuda:0', dtype=torch.int64)
    amax = rand_strided((4096, 1), (1, 1), device='cuda:0', dtype=torch.float32)
    log = rand_strided((4096, 1), (1, 1), device='cuda:0', dtype=torch.float32)
    tangents_1 = rand_strided((4096, ), (1, ), device='cuda:0', dtype=torch.bfloat16)
    return [primals_1, primals_2, amax, log, tangents_1]


def benchmark_compiled_module(args, times=10, repeat=10):
    from torch._inductor.utils import print_performance
    fn = lambda: call(list(args))
    return print_performance(fn, times=times, repeat=repeat)


if __name__ == "__main__":
    from torch._inductor.wrapper_benchmark import compiled_module_main
    args = get_args()
    compiled_module_main('None', lambda times, repeat: benchmark_compiled_module(args, times=times, repeat=repeat))
