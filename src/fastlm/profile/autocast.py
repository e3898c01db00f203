"""What `torch.autocast` actually does to dtypes, and why low-precision sums need an fp32 accumulator.

Two small experiments behind `fastlm inspect autocast`:
- a toy model (Linear -> ReLU -> LayerNorm -> Linear) takes one forward, cross-entropy loss and
  backward under autocast; forward hooks record the dtype of every layer's output, next to the
  dtypes of the parameters, the loss and the gradients. Nothing is assumed: the table shows what
  this torch build does on this device (CUDA and CPU autocast use different op lists).
- ``terms`` copies of 0.01 are summed one by one with the accumulator in fp32, fp16 and bf16, and
  with fp16 values added into an fp32 accumulator, against the exact ``terms * 0.01``.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from fastlm.utils.tables import markdown_table

AUTOCAST_DTYPES = (torch.float16, torch.bfloat16)
LAYERS = ("fc1", "relu", "ln", "fc2")  # ToyModel's children, in forward order


class ToyModel(nn.Module):
    """Linear(in, hidden) -> ReLU -> LayerNorm(hidden) -> Linear(hidden, out), all with biases."""

    def __init__(self, in_features: int = 32, hidden: int = 64, out_features: int = 10) -> None:
        super().__init__()
        self.fc1 = nn.Linear(in_features, hidden)
        self.relu = nn.ReLU()
        self.ln = nn.LayerNorm(hidden)
        self.fc2 = nn.Linear(hidden, out_features)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.ln(self.relu(self.fc1(x))))  # (B, in) -> (B, out)


def dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).removeprefix("torch.")


def autocast_dtypes(
    device: torch.device, dtype: torch.dtype, *, batch: int = 8, in_features: int = 32, hidden: int = 64
) -> list[dict]:
    """One training step of `ToyModel` under ``torch.autocast(device.type, dtype=dtype)``.

    Rows have keys autocast, device, tensor, role (parameter | layer output | logits | loss |
    gradient) and dtype, in the order the step produces them. If this device's autocast does not
    support ``dtype``, or the step fails, a single row with role "unsupported" and the reason in
    "note" is returned instead.
    """
    base = {"autocast": dtype_name(dtype), "device": device.type}

    def unsupported(reason: str) -> list[dict]:
        return [{**base, "tensor": "—", "role": "unsupported", "dtype": None, "note": reason}]

    if not torch.amp.is_autocast_available(device.type):
        return unsupported(f"torch.autocast is not available for device type {device.type!r}")
    # An unsupported dtype either raises here (bf16 on a pre-Ampere GPU) or warns and disables
    # autocast (CPU before fp16 support): catch both, so the warning becomes the row's reason.
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            context = torch.autocast(device.type, dtype=dtype)
    except RuntimeError as error:
        return unsupported(str(error).splitlines()[0])

    model = ToyModel(in_features, hidden).to(device)
    out_features = model.fc2.out_features
    rows = [{**base, "tensor": name, "role": "parameter", "dtype": p.dtype} for name, p in model.named_parameters()]
    outputs: dict[str, torch.dtype] = {}

    def record(name: str):
        def hook(_module: nn.Module, _inputs: tuple, output: torch.Tensor) -> None:
            outputs[name] = output.dtype

        return hook

    hooks = [getattr(model, name).register_forward_hook(record(name)) for name in LAYERS]
    x = torch.randn(batch, in_features, device=device)
    targets = torch.randint(0, out_features, (batch,), device=device)
    try:
        with context:
            if not torch.is_autocast_enabled(device.type):
                reason = "; ".join(str(w.message).splitlines()[0] for w in caught) or "autocast stayed disabled"
                return unsupported(reason)
            logits = model(x)  # (B, out)
            loss = F.cross_entropy(logits, targets)
        loss.backward()  # outside the context, as torch recommends: backward ops reuse the forward's dtypes
    except RuntimeError as error:  # e.g. a kernel missing for this dtype on this device
        return unsupported(str(error).splitlines()[0])
    finally:
        for hook in hooks:
            hook.remove()

    rows += [{**base, "tensor": name, "role": "layer output", "dtype": outputs[name]} for name in LAYERS]
    rows.append({**base, "tensor": "logits", "role": "logits", "dtype": logits.dtype})
    rows.append({**base, "tensor": "loss", "role": "loss", "dtype": loss.dtype})
    rows += [
        {**base, "tensor": f"{name}.grad", "role": "gradient", "dtype": p.grad.dtype}
        for name, p in model.named_parameters()
    ]
    return [{**row, "dtype": dtype_name(row["dtype"])} for row in rows]


def _sum_repeated(value: float, terms: int, accumulator: torch.dtype, values: torch.dtype) -> float:
    """``value`` stored in ``values``, added ``terms`` times into a 0 of dtype ``accumulator``."""
    total = torch.zeros((), dtype=accumulator)
    term = torch.tensor(value, dtype=values).to(accumulator)  # widening fp16 -> fp32 is exact
    for _ in range(terms):
        total = total + term  # rounded to the accumulator's dtype after every add, as a running sum in a register
    return total.item()


def accumulation_error(terms: int = 1000, value: float = 0.01) -> list[dict]:
    """Sum ``terms`` copies of ``value`` one at a time, in four precisions.

    Rows have keys case, accumulator, values (dtype names), terms, value, result, exact and
    abs_error (``|result - exact|``, with ``exact = terms * value`` in float64).

    Two errors add up: rounding ``value`` to the values' dtype (0.01 is not exact in any binary
    format), and rounding the running total after every add, which dominates once the total's
    spacing (ulp) approaches ``value``: past that point each add moves the total by a rounded
    number of ulps, or not at all.
    """
    if terms <= 0:
        raise ValueError(f"terms must be a positive integer, got {terms}")
    exact = terms * value
    cases = (
        ("fp32", torch.float32, torch.float32),
        ("fp16", torch.float16, torch.float16),
        ("bf16", torch.bfloat16, torch.bfloat16),
        ("fp16 values, fp32 accumulator", torch.float32, torch.float16),
    )
    rows = []
    for case, accumulator, values in cases:
        result = _sum_repeated(value, terms, accumulator, values)
        rows.append(
            {
                "case": case,
                "accumulator": dtype_name(accumulator),
                "values": dtype_name(values),
                "terms": terms,
                "value": value,
                "result": result,
                "exact": exact,
                "abs_error": abs(result - exact),
            }
        )
    return rows


def _dtype_table(dtype_rows: Sequence[dict]) -> str:
    """One row per tensor, one dtype column per autocast dtype; notes for unsupported dtypes below."""
    autocasts = list(dict.fromkeys(row["autocast"] for row in dtype_rows))
    tensors: dict[str, dict] = {}
    notes = []
    for row in dtype_rows:
        if row["role"] == "unsupported":
            notes.append(f"- {row['autocast']} on {row['device']}: {row['note']}")
            continue
        entry = tensors.setdefault(row["tensor"], {"tensor": row["tensor"], "role": row["role"]})
        entry[row["autocast"]] = row["dtype"]
    columns = [("tensor", "tensor"), ("role", "role")] + [(a, f"under autocast({a})") for a in autocasts]
    return "\n".join([markdown_table(list(tensors.values()), columns), *notes])


def render(dtype_rows: Sequence[dict], accumulation_rows: Sequence[dict]) -> str:
    """Markdown: the dtype of every tensor per autocast dtype, then the accumulation errors."""
    devices = ", ".join(dict.fromkeys(row["device"] for row in dtype_rows))
    # more digits than format_value's 3: the fp32 error is in the 4th decimal
    accumulation = [
        {**row, "result": f"{row['result']:.6f}", "exact": f"{row['exact']:g}", "abs_error": f"{row['abs_error']:.2e}"}
        for row in accumulation_rows
    ]
    summed = f"{accumulation_rows[0]['terms']} x {accumulation_rows[0]['value']:g}" if accumulation_rows else "nothing"
    accumulation_columns = [
        ("case", "case"),
        ("accumulator", "accumulator"),
        ("values", "values"),
        ("result", "result"),
        ("exact", "exact"),
        ("abs_error", "abs error"),
    ]
    return "\n\n".join(
        [
            f"### Tensor dtypes after one training step of ToyModel under torch.autocast ({devices})",
            _dtype_table(dtype_rows),
            f"### Sequential sum of {summed}, one term at a time",
            markdown_table(accumulation, accumulation_columns),
        ]
    )


def autocast_report(device: torch.device, terms: int = 1000) -> str:
    """Everything `fastlm inspect autocast` prints: both experiments, rendered."""
    dtype_rows = [row for dtype in AUTOCAST_DTYPES for row in autocast_dtypes(device, dtype)]
    return render(dtype_rows, accumulation_error(terms))
