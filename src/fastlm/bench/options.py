"""Option values of the benchmarks that load torch: their choices and their device-dependent defaults.

They live here, without torch, so that the command line can build its parser, print `--help` and
check a value without importing torch or Triton (seconds); the benchmarks import them from here.
"""

from __future__ import annotations

# `fastlm bench host` (fastlm.bench.host)
# the keys of fastlm.bench.host_cases.CASES, in its order (tests/bench/test_host_bench.py holds them equal)
HOST_OPS = (
    "cross_entropy",
    "flash_attention",
    "rms_norm",
    "layer_norm",
    "masked_softmax",
    "causal_conv1d",
    "weighted_sum",
    "rotary_embedding",
)
HOST_COMPILE_MODES = ("eager", "compile")
# Calls per round, rounds and warm-up calls: full on a GPU; a few on CPU, where the numbers are
# reference paths and `fastlm report` must stay quick.
HOST_GPU_CALLS, HOST_GPU_ROUNDS, HOST_GPU_WARMUP = 200, 5, 10
HOST_CPU_CALLS, HOST_CPU_ROUNDS, HOST_CPU_WARMUP = 10, 3, 2
HOST_MIN_ROUNDS = 3  # a median and a spread

# `fastlm bench attention` (fastlm.bench.attention)
ATTENTION_SWEEPS = ("naive", "compile", "flash", "model", "varlen", "window")

# `fastlm bench hf` (fastlm.bench.hf)
HF_FAMILIES = ("llama", "qwen3", "mistral", "olmo2", "phi3", "granite", "smollm3", "gemma3_text", "gemma2", "qwen3_moe")
HF_SIZES = ("tiny", "1b", "3b", "8b", "a3b")  # the keys of fastlm.bench.hf.SIZES for each family
HF_PATCHES = ("none", "fastlm", "liger")  # the model as it is, fastlm.apply_fastlm, Liger-Kernel's instance patch
HF_PATCH_CHOICES = (*HF_PATCHES, "fastlm-fp8")  # and on request apply_fastlm(model, fp8=True)

# `fastlm bench moe` (fastlm.bench.moe): the keys of its LAYERS, and the token counts measured
MOE_LAYERS = ("qwen3-30b-a3b", "mixtral-8x7b", "gpt-oss-20b")
MOE_TOKENS = (4096, 16384)
