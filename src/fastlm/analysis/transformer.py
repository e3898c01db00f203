"""Napkin math for the pieces of one Transformer layer run unfused: FLOPs, bytes, intensity, bound.

Input X is (B, N, D): batch B, sequence length N, model width D; H heads of head dim d = D/H;
every tensor (activations, weights, the additive mask) is stored with n_bytes per element.

Conventions:
- a multiply-add is 2 FLOPs; add, sub, mul, div, max, exp and tanh are 1 FLOP each;
- every stage is a separate kernel: it reads each input from DRAM once and writes its output once,
  so an intermediate (S, P, the 4D hidden) is counted when written and again when read. This is
  the materialized baseline a fused kernel (FlashAttention, a fused GELU epilogue) is measured
  against, and the bytes are a floor for it (nothing is re-read from DRAM);
- the (B, H, N, N) score matrices are computed in full; the causal mask only edits them, and
  no FLOPs are saved for the masked half (unlike `attention.attention_forward_flops`'s causal
  count, which is the convention for reporting TFLOP/s, not what this baseline executes).

Scaled-dot-product attention, per stage (summed over heads: B*H*N*N*d = B*N*N*D):
    QK^T/sqrt(d)  FLOPs 2BN^2D        reads Q, K 2BND       writes S  BHN^2
                  (the 1/sqrt(d) scale is fused into the product or folded into Q: not counted)
    causal mask   FLOPs BHN^2         reads S, mask BHN^2 + N^2   writes S  BHN^2
                  (additive (N, N) mask, read once: a floor, a kernel that broadcasts it over
                  (B, H) from L2; re-reading it per (b, h) would add (BH - 1) N^2)
    softmax       FLOPs 5 BHN^2       reads S BHN^2         writes P  BHN^2
                  (per element: max, subtract, exp, sum, divide)
    AV            FLOPs 2BN^2D        reads P, V BHN^2 + BND  writes O  BND
Projections (weights D x D):
    Q/K/V         FLOPs 3 * 2BND^2    reads X three times and 3 weights 3BND + 3D^2   writes 3BND
                  (three separate matmuls; one fused QKV matmul would read X once: 2BND less)
    output        FLOPs 2BND^2        reads O and W_o BND + D^2   writes BND
MLP D -> 4D -> D:
    up            FLOPs 2BN(D)(4D)    reads X, W_up BND + 4D^2    writes 4BND
    activation    FLOPs 8 * 4BND      reads 4BND                  writes 4BND
                  (tanh GELU per element: u = x(c1 + c2 x^2) 4, tanh 1, (0.5x)(1 + t) 3)
    down          FLOPs 2BN(4D)(D)    reads H, W_down 4BND + 4D^2 writes BND
Bytes are the element counts above times n_bytes. Biases and the residual add are left out.

Roofline: matmul stages run on the tensor cores, so their verdict compares intensity with
`spec.ridge_flops_per_byte` and their time floor uses `spec.matmul_tflops`; the elementwise
stages (mask, softmax, activation) run on the CUDA cores: `spec.vector_ridge_flops_per_byte` and
`spec.vector_fp32_tflops`. The tensor-core rate is the spec's 16-bit datasheet rate whatever
n_bytes is (fp32 matmuls would run at the TF32 rate, fp8 faster on cards that have it).
A total (`sdpa_total`, `mha_total`, `mlp_total`) sums FLOPs and bytes of its stages and is
tagged matmul: its min time assumes every FLOP at the tensor-core rate with memory traffic fully
overlapped, a floor below the sum of the per-stage floors (what running them one by one costs).

Scaling with N: the stages touching the N x N scores (QK^T, mask, softmax, AV) grow as N^2 in
FLOPs and in their leading bytes term; projections, the MLP, and their weights grow as N (the
weight bytes do not grow at all). A total is labelled by its leading term: "N^2" if any of its
stages is, although a total that mixes both kinds grows by less than 4x when N doubles.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.table import Table

from fastlm.analysis.attention import SOFTMAX_FLOPS_PER_ELEMENT, scores_bytes
from fastlm.analysis.roofline import Bound
from fastlm.analysis.tables import add_columns
from fastlm.devices import DeviceSpec
from fastlm.utils.tables import format_value, si, si_seconds

ELEMENT_SIZES = {1: "fp8", 2: "fp16/bf16", 4: "fp32"}  # n_bytes accepted, and what they stand for
DTYPE_BYTES = {"fp8": 1, "fp16": 2, "bf16": 2, "fp32": 4}  # the element types by name, for the tables
MASK_FLOPS_PER_ELEMENT = 1  # one add of the additive mask
GELU_FLOPS_PER_ELEMENT = 8  # tanh approximation, counted in the module docstring
MLP_EXPANSION = 4  # hidden width of the MLP is 4D
SCALINGS = ("N", "N^2")


@dataclass(frozen=True)
class Stage:
    name: str
    flops: int
    bytes_read: int
    bytes_written: int
    matmul: bool  # tensor cores (True) or CUDA-core elementwise math (False): picks rate and ridge
    scaling: str  # "N" or "N^2": how FLOPs (and the leading bytes term) grow with sequence length

    def __post_init__(self) -> None:
        if self.scaling not in SCALINGS:
            raise ValueError(f"scaling must be one of {', '.join(SCALINGS)}, got {self.scaling!r}")

    @property
    def bytes(self) -> int:
        return self.bytes_read + self.bytes_written

    @property
    def intensity(self) -> float:
        """FLOPs per byte moved through DRAM."""
        return self.flops / self.bytes

    def bound(self, spec: DeviceSpec) -> Bound:
        rate_tflops = spec.matmul_tflops if self.matmul else spec.vector_fp32_tflops
        return Bound(self.flops, self.bytes, rate_tflops * 1e12, spec.memory_gbps * 1e9)

    def min_time_s(self, spec: DeviceSpec) -> float:
        """max(bytes / bandwidth, FLOPs / rate of the unit doing the math)."""
        return self.bound(spec).min_time_s

    def verdict(self, spec: DeviceSpec) -> str:
        """'compute-bound' or 'memory-bound' against the ridge of the unit doing the math."""
        return self.bound(spec).verdict


def _check_sizes(n_bytes: int, **sizes: int) -> None:
    for name, value in sizes.items():
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if n_bytes not in ELEMENT_SIZES:
        known = ", ".join(f"{n} ({dtype})" for n, dtype in ELEMENT_SIZES.items())
        raise ValueError(f"n_bytes must be one of {known}, got {n_bytes!r}")
    if "H" in sizes and sizes["D"] % sizes["H"]:
        raise ValueError(f"D must be divisible by H (head dim D/H), got D={sizes['D']}, H={sizes['H']}")


def _total(name: str, stages: list[Stage]) -> Stage:
    return Stage(
        name,
        flops=sum(s.flops for s in stages),
        bytes_read=sum(s.bytes_read for s in stages),
        bytes_written=sum(s.bytes_written for s in stages),
        matmul=True,
        scaling="N^2" if any(s.scaling == "N^2" for s in stages) else "N",
    )


def attention_stages(B: int, N: int, D: int, H: int, n_bytes: int) -> list[Stage]:
    """QK^T/sqrt(d), causal mask, softmax, AV over materialized (B, H, N, N) scores."""
    _check_sizes(n_bytes, B=B, N=N, D=D, H=H)
    scores = scores_bytes(B, H, N, N, n_bytes)  # one (B, H, N, N) tensor: S or P
    activation = B * N * D * n_bytes  # one (B, N, D) tensor: Q, K, V or O
    elements = B * H * N * N
    return [
        Stage("QK^T/sqrt(d)", 2 * B * N * N * D, 2 * activation, scores, matmul=True, scaling="N^2"),
        Stage(
            "causal mask",
            MASK_FLOPS_PER_ELEMENT * elements,
            scores + N * N * n_bytes,
            scores,
            matmul=False,
            scaling="N^2",
        ),
        Stage("softmax", SOFTMAX_FLOPS_PER_ELEMENT * elements, scores, scores, matmul=False, scaling="N^2"),
        Stage("AV", 2 * B * N * N * D, scores + activation, activation, matmul=True, scaling="N^2"),
    ]


def sdpa_total(B: int, N: int, D: int, H: int, n_bytes: int) -> Stage:
    return _total("scaled-dot-product attention", attention_stages(B, N, D, H, n_bytes))


def projection_stages(B: int, N: int, D: int, n_bytes: int) -> list[Stage]:
    """The Q/K/V projections (three D x D matmuls, X read by each) and the output projection."""
    _check_sizes(n_bytes, B=B, N=N, D=D)
    activation = B * N * D * n_bytes
    weight = D * D * n_bytes
    matmul_flops = 2 * B * N * D * D
    return [
        Stage(
            "Q/K/V projections", 3 * matmul_flops, 3 * (activation + weight), 3 * activation, matmul=True, scaling="N"
        ),
        Stage("output projection", matmul_flops, activation + weight, activation, matmul=True, scaling="N"),
    ]


def mha_stages(B: int, N: int, D: int, H: int, n_bytes: int) -> list[Stage]:
    """Multi-head attention in execution order: Q/K/V projections, the SDPA stages, output projection."""
    qkv, output = projection_stages(B, N, D, n_bytes)
    return [qkv, *attention_stages(B, N, D, H, n_bytes), output]


def mha_total(B: int, N: int, D: int, H: int, n_bytes: int) -> Stage:
    return _total("multi-head attention", mha_stages(B, N, D, H, n_bytes))


def mlp_stages(B: int, N: int, D: int, n_bytes: int) -> list[Stage]:
    """D -> 4D (up), GELU on the (B, N, 4D) hidden, 4D -> D (down)."""
    _check_sizes(n_bytes, B=B, N=N, D=D)
    activation = B * N * D * n_bytes  # (B, N, D)
    hidden = MLP_EXPANSION * activation  # (B, N, 4D)
    weight = MLP_EXPANSION * D * D * n_bytes  # (D, 4D) or (4D, D)
    matmul_flops = 2 * B * N * D * (MLP_EXPANSION * D)
    hidden_elements = MLP_EXPANSION * B * N * D
    return [
        Stage("up projection", matmul_flops, activation + weight, hidden, matmul=True, scaling="N"),
        Stage("activation", GELU_FLOPS_PER_ELEMENT * hidden_elements, hidden, hidden, matmul=False, scaling="N"),
        Stage("down projection", matmul_flops, hidden + weight, activation, matmul=True, scaling="N"),
    ]


def mlp_total(B: int, N: int, D: int, n_bytes: int) -> Stage:
    return _total("MLP", mlp_stages(B, N, D, n_bytes))


# (key, header) pairs for `fastlm.utils.tables.markdown_table(render_stages(...), STAGE_COLUMNS)`
STAGE_COLUMNS = [
    ("stage", "stage"),
    ("flops", "FLOPs"),
    ("bytes", "bytes"),
    ("intensity", "FLOP/B"),
    ("verdict", "bound"),
    ("min_time_us", "min time (µs)"),
    ("scaling", "scales as"),
]


def render_stages(stages: list[Stage], spec: DeviceSpec) -> list[dict]:
    """One row per stage with the keys of STAGE_COLUMNS; numbers stay numbers for the caller to format."""
    return [
        {
            "stage": s.name,
            "flops": s.flops,
            "bytes": s.bytes,
            "intensity": s.intensity,
            "verdict": s.verdict(spec),
            "min_time_us": s.min_time_s(spec) * 1e6,
            "scaling": s.scaling,
        }
        for s in stages
    ]


def layer_stages(layer: str, B: int, N: int, D: int, H: int, n_bytes: int) -> list[Stage]:
    """The stages of ``layer`` (attention, mha or mlp; mlp has no heads and ignores H), then their total."""
    if layer == "attention":
        return [*attention_stages(B, N, D, H, n_bytes), sdpa_total(B, N, D, H, n_bytes)]
    if layer == "mha":
        return [*mha_stages(B, N, D, H, n_bytes), mha_total(B, N, D, H, n_bytes)]
    if layer == "mlp":
        return [*mlp_stages(B, N, D, n_bytes), mlp_total(B, N, D, n_bytes)]
    raise ValueError(f"layer must be attention, mha or mlp, got {layer!r}")


def layer_tables(layer: str, B: int, N: int, D: int, H: int, dtype: str, spec: DeviceSpec) -> list[Table | str]:
    """What `fastlm analyze attention|mha|mlp` prints: the table of `layer_stages` in element type
    ``dtype`` (a key of DTYPE_BYTES) on ``spec``, then a note on how to read it."""
    stages = layer_stages(layer, B, N, D, H, DTYPE_BYTES[dtype])
    heads = f", H={H} (head dim {D // H})" if layer != "mlp" else ""
    table = Table(
        title=f"{layer} · B={B}, N={N}, D={D}{heads}, {dtype} · {spec.name} "
        f"(ridge {spec.ridge_flops_per_byte:.0f} FLOP/B tensor cores, "
        f"{spec.vector_ridge_flops_per_byte:.1f} CUDA cores)"
    )
    headers = dict(STAGE_COLUMNS)
    add_columns(table, (headers["stage"],), [headers[key] for key in ("flops", "bytes", "intensity")])
    table.add_column(headers["verdict"], no_wrap=True)
    table.add_column("min time", justify="right", no_wrap=True)
    table.add_column(headers["scaling"], max_width=len("scales"))  # values are N or N^2: the header wraps
    rows = render_stages(stages, spec)
    table.columns[0].min_width = max(len(word) for row in rows for word in row["stage"].split())  # words stay whole
    for row in rows:
        table.add_row(
            row["stage"],
            si(row["flops"]),
            si(row["bytes"], "B"),
            format_value(row["intensity"]),
            row["verdict"].removesuffix("-bound"),
            si_seconds(row["min_time_us"] * 1e-6),
            row["scaling"],
        )
    return [
        table,
        "Every stage unfused: each reads its inputs from memory and writes its output once (module "
        "fastlm.analysis.transformer has the formulas). 'bound' is what limits the stage: memory or "
        "compute; 'scales as' is how FLOPs and bytes grow with N.",
    ]
