"""`fastlm.profile.autocast` on CPU: dtypes under bf16 autocast, the accumulation demo, the rendered tables.

On CPU, torch's autocast runs linear in the low-precision dtype and the loss in fp32 but, unlike
CUDA's op list, leaves layer_norm in its input's dtype; these tests assert only what CPU autocast
does, and the CUDA expectations (layer_norm in fp32) sit in the `gpu` test.
"""

import pytest
import torch

from fastlm.profile.autocast import LAYERS, ToyModel, accumulation_error, autocast_dtypes, render


def _dtypes(rows: list[dict], role: str) -> dict[str, str]:
    return {row["tensor"]: row["dtype"] for row in rows if row["role"] == role}


@pytest.fixture(scope="module")
def cpu_bf16_rows() -> list[dict]:
    return autocast_dtypes(torch.device("cpu"), torch.bfloat16)


def test_bf16_autocast_on_cpu_lowers_linear_keeps_params_grads_loss_fp32(cpu_bf16_rows):
    params = [name for name, _ in ToyModel().named_parameters()]
    assert _dtypes(cpu_bf16_rows, "parameter") == dict.fromkeys(params, "float32")
    assert _dtypes(cpu_bf16_rows, "gradient") == {f"{name}.grad": "float32" for name in params}
    outputs = _dtypes(cpu_bf16_rows, "layer output")
    assert list(outputs) == list(LAYERS)
    assert outputs["fc1"] == outputs["fc2"] == "bfloat16"
    assert _dtypes(cpu_bf16_rows, "logits") == {"logits": "bfloat16"}
    assert _dtypes(cpu_bf16_rows, "loss") == {"loss": "float32"}
    assert all(row["autocast"] == "bfloat16" and row["device"] == "cpu" for row in cpu_bf16_rows)


def test_unsupported_autocast_dtype_is_a_row_not_an_error():
    rows = autocast_dtypes(torch.device("cpu"), torch.float64)  # torch's warning becomes the note
    assert len(rows) == 1
    assert rows[0]["role"] == "unsupported" and "not supported" in rows[0]["note"]


@pytest.mark.gpu
def test_cuda_autocast_keeps_layer_norm_and_loss_fp32():
    for dtype in (torch.float16, torch.bfloat16):
        rows = autocast_dtypes(torch.device("cuda"), dtype)
        name = str(dtype).removeprefix("torch.")
        outputs = _dtypes(rows, "layer output")
        assert outputs["fc1"] == outputs["fc2"] == name
        assert outputs["ln"] == "float32"  # layer_norm is on CUDA autocast's fp32 list
        assert _dtypes(rows, "loss") == {"loss": "float32"}
        assert set(_dtypes(rows, "gradient").values()) == {"float32"}


def test_accumulation_error_orders_fp32_fp16_bf16():
    rows = {row["case"]: row for row in accumulation_error(1000)}
    assert all(row["exact"] == pytest.approx(10.0) for row in rows.values())
    assert rows["fp32"]["abs_error"] < 1e-3
    assert rows["fp16"]["abs_error"] > 1e-2
    assert rows["bf16"]["abs_error"] > rows["fp16"]["abs_error"]
    # an fp32 accumulator removes the running-sum error; what is left is 0.01's rounding to fp16
    mixed = rows["fp16 values, fp32 accumulator"]
    assert mixed["abs_error"] < rows["fp16"]["abs_error"] / 10
    assert mixed["result"] == pytest.approx(1000 * torch.tensor(0.01, dtype=torch.float16).item(), rel=1e-5)


def test_accumulation_error_rejects_non_positive_terms():
    with pytest.raises(ValueError, match="terms"):
        accumulation_error(0)


def test_render_has_both_tables(cpu_bf16_rows):
    unsupported = autocast_dtypes(torch.device("cpu"), torch.float64)
    text = render(cpu_bf16_rows + unsupported, accumulation_error(100))
    assert "| tensor | role | under autocast(bfloat16) | under autocast(float64) |" in text
    assert "| case | accumulator | values | result | exact | abs error |" in text
    assert "- float64 on cpu: " in text
    assert "Sequential sum of 100 x 0.01" in text
