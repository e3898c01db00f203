"""What torch.compile needs from every fastlm triton_op."""

import json
import os
import subprocess
import sys

TRITON_OPS = {
    "fastlm::norm_forward": ["_norm_forward_kernel"],
    "fastlm::norm_backward": ["_norm_backward_kernel", "_norm_param_grad_kernel", "_sum_partials_kernel"],
    "fastlm::masked_softmax_forward": ["_softmax_forward_kernel"],
    "fastlm::masked_softmax_backward": ["_softmax_backward_kernel"],
    "fastlm::causal_conv1d_forward": ["_conv1d_forward_kernel"],
    "fastlm::causal_conv1d_backward": ["_conv1d_dz_kernel", "_conv1d_input_grad_kernel"],
    "fastlm::flash_attention_forward": ["_flash_forward_kernel"],
    "fastlm::flash_attention_backward": ["_flash_backward_dq_kernel", "_flash_backward_dkdv_kernel"],
    "fastlm::cross_entropy_forward": ["_cross_entropy_forward_kernel"],
    "fastlm::cross_entropy_backward": ["_cross_entropy_backward_kernel"],
    "fastlm::cross_entropy_fused": ["_cross_entropy_fused_kernel"],
    "fastlm::cross_entropy_scale_rows_": ["_scale_rows_kernel"],
    "fastlm::linear_cross_entropy_losses": ["_cross_entropy_forward_kernel"],
    "fastlm::linear_cross_entropy_gradients": ["_cross_entropy_fused_kernel"],
    "fastlm::rotary_forward": ["_rotary_kernel"],
    "fastlm::rotary_backward": ["_rotary_kernel"],
    "fastlm::swiglu_forward": ["_glu_forward_kernel"],
    "fastlm::swiglu_backward": ["_glu_backward_kernel"],
    "fastlm::geglu_forward": ["_glu_forward_kernel"],
    "fastlm::geglu_backward": ["_glu_backward_kernel"],
    "fastlm::weighted_sum_forward": ["_weighted_sum_forward_kernel"],
    "fastlm::weighted_sum_backward": ["_weighted_sum_backward_kernel"],
    "fastlm::moe_experts_forward": ["_grouped_matmul_kernel", "_combine_kernel"],
    "fastlm::moe_experts_backward": [
        "_grouped_matmul_kernel",
        "_grouped_weight_grad_kernel",
        "_combine_kernel",
        "_combine_weight_grad_kernel",
    ],
}

# Outside the interpreter (which replaces compiled kernels with Python functions torch does not
# recognize), in a fresh process: which kernels torch found in each registered op.
FOUND = """
import json
import fastlm, fastlm.ops.moe, fastlm.ops.weighted_sum
for name in fastlm.__all__:  # each export's op module registers its ops when first used
    getattr(fastlm, name)
from torch._library.triton import triton_ops_to_kernels
print(json.dumps({op: sorted(k.fn.__name__ for k in kernels) for op, kernels in triton_ops_to_kernels.items()
                  if op.startswith("fastlm::")}))
"""


def test_torch_finds_every_kernel_of_every_triton_op():
    # torch.compile's caches key a triton_op on the source of the kernels it finds in the op's
    # code; a kernel it misses could let a cache serve compiled code from before an edit.
    env = {key: value for key, value in os.environ.items() if key != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-c", FOUND], capture_output=True, text=True, env=env, check=True)
    found = json.loads(result.stdout.strip().splitlines()[-1])
    assert found == {op: sorted(kernels) for op, kernels in TRITON_OPS.items()}
