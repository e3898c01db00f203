"""Eager attention at the small preset's shape (B=8, H=12, L=512, D=64, causal, bf16): fastlm's
flash attention against `scaled_dot_product_attention`, host time per forward call and per
forward+backward call, and GPU time of the same two (CUDA-graph replays, so no host cost).

The host time is the wall time of 100 forward calls (20 forward+backward calls) enqueued behind
about 150 ms of queued matmuls, so the GPU never waits on them and the loop measures the Python /
dispatch path alone (the backward's too: autograd's device thread enqueues it, and the call returns
once it is enqueued). Fewer forward+backward calls, since each enqueues several kernels: with
100 of them behind the matmuls the launch queue fills, and launches wait for the GPU.
Usage: python benchmarks/profile_attention_host.py  (a CUDA GPU)
"""

import time

import torch
import torch.nn.functional as F

from fastlm import flash_attention

B, H, L, D = 8, 12, 512, 64


def host_us(call, busy: torch.Tensor, n: int = 100) -> float:
    for _ in range(10):
        call()
    torch.cuda.synchronize()
    for _ in range(150):
        busy @ busy  # about 1 ms each on an H100: the GPU stays behind the host below
    start = time.perf_counter()
    for _ in range(n):
        call()
    elapsed = (time.perf_counter() - start) / n * 1e6
    torch.cuda.synchronize()
    return elapsed


def graph_us(call, leaves, n: int = 50) -> float:
    for _ in range(3):
        call()
    torch.cuda.synchronize()
    for t in leaves:
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    for t in leaves:
        t.grad = None  # gradients captured in the graph's pool must not leak out
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for _ in range(5):
        graph.replay()
    start.record()
    for _ in range(n):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / n * 1000


def main():
    q, k, v = (torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    dy = torch.randn(B, H, L, D, device="cuda", dtype=torch.bfloat16)
    busy = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    implementations = {
        "fastlm": lambda: flash_attention(q, k, v, causal=True),
        "sdpa": lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True),
    }
    print(f"{torch.cuda.get_device_name()}, B={B} H={H} L={L} D={D} causal bf16")
    for name, forward in implementations.items():

        def forward_backward(forward=forward):
            forward().backward(dy)

        host = [host_us(forward, busy, n=100), host_us(forward_backward, busy, n=20)]
        for t in (q, k, v):
            t.grad = None
        gpu = [graph_us(call, (q, k, v)) for call in (forward, forward_backward)]
        print(
            f"{name}: host {host[0]:.1f} us forward, {host[1]:.1f} us fwd+bwd per call; "
            f"GPU {gpu[0]:.1f} us forward, {gpu[1]:.1f} us fwd+bwd"
        )


if __name__ == "__main__":
    main()
