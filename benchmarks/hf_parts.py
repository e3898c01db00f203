"""Each part `apply_fastlm` replaces, timed against what it replaces, at a Hugging Face model's shapes.

Through autograd in eager mode, under bf16 autocast with fp32 weights, as `fastlm bench hf` steps
the model: forward + backward of one decoder layer's RMSNorm before its MLP (OLMo 2: after
attention), its attention block (projections, RoPE, attention), its MLP, and the loss (LM head +
cross-entropy, given the final hidden states).
Both sides are the same module of the same layer, one of them patched. Timed by
`fastlm.harness.timing.measure` (CUDA events, L2 flushed, median and p20 / p80). Appends records to
benchmarks/results/hf_parts.jsonl.

    python3 benchmarks/hf_parts.py --family llama --size 1b --batch 4 --seq 2048
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import torch

from fastlm.bench.hf import HFShape, build_model
from fastlm.bench.options import HF_FAMILIES
from fastlm.harness.timing import measure
from fastlm.integrations.huggingface import apply_fastlm, causal_lm_loss
from fastlm.utils.records import append_records, with_environment

ROOT = Path(__file__).resolve().parents[1]


def parts(model: torch.nn.Module, fused_loss: bool, hidden: torch.Tensor, labels: torch.Tensor) -> dict:
    """name -> a call of that part of ``model`` on ``hidden``; the loss is the patch's fused one
    with ``fused_loss``, else transformers' (the patch replaces the model's forward, not a module)."""
    layer = model.model.layers[0]
    positions = torch.arange(hidden.shape[1], device=hidden.device)[None]
    cos_sin = model.model.rotary_emb(hidden, positions)

    def loss_of(h):
        if fused_loss:
            return causal_lm_loss(h, model.lm_head, labels)
        return model.loss_function(model.lm_head(h), labels, model.config.vocab_size)

    return {
        "rms_norm": lambda h: layer.post_attention_layernorm(h),  # every family has it (OLMo 2: after attention)
        "attention (+rope)": lambda h: layer.self_attn(h, cos_sin, None)[0],
        "mlp (swiglu)": lambda h: layer.mlp(h),
        "loss": loss_of,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--family", default="llama", choices=[f for f in HF_FAMILIES if f != "qwen3_moe"])
    parser.add_argument("--size", default="1b")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=2048)
    args = parser.parse_args()
    device = torch.device("cuda")
    shape = HFShape.of(args.family, args.size, args.seq, num_layers=1)
    torch.manual_seed(0)
    with device:
        unpatched = build_model(shape).train()
        patched = apply_fastlm(copy.deepcopy(unpatched)).train()
        hidden = torch.randn(args.batch, args.seq, shape.d_model, requires_grad=True)
        labels = torch.randint(0, shape.vocab_size, (args.batch, args.seq))
    records = []
    for name in parts(unpatched, False, hidden, labels):
        times = {}
        for implementation, model in (("hf", unpatched), ("hf+fastlm", patched)):
            part = parts(model, implementation == "hf+fastlm", hidden, labels)[name]
            leaves = [hidden, *model.parameters()]

            def step(part=part):
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    out = part(hidden)
                (out.float().sum() if out.dim() else out).backward()

            times[implementation] = measure(step, device, grad_to_none=leaves)
            records.append(
                with_environment(
                    {
                        "op": "hf_part",
                        "part": name,
                        "implementation": implementation,
                        "family": args.family,
                        "size": args.size,
                        "batch": args.batch,
                        "seq": args.seq,
                        "precision": "bf16",
                        "mode": "fwd+bwd",
                        "median_ms": times[implementation].median_ms,
                        "p20_ms": times[implementation].p20_ms,
                        "p80_ms": times[implementation].p80_ms,
                    }
                )
            )
        ours, theirs = times["hf+fastlm"], times["hf"]
        print(
            f"{name:>18}: hf {theirs.median_ms:7.3f} ms ({theirs.p20_ms:.3f}-{theirs.p80_ms:.3f}), fastlm "
            f"{ours.median_ms:7.3f} ms ({ours.p20_ms:.3f}-{ours.p80_ms:.3f}): "
            f"{theirs.median_ms / ours.median_ms:.2f}x"
        )
    append_records(ROOT / "benchmarks" / "results" / "hf_parts.jsonl", records)


if __name__ == "__main__":
    main()
