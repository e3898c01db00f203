"""Transformer-layer cost model pinned to values computed by hand.

Two shapes:
- a small one with no powers of two, B=3, N=5, D=6, H=2, fp32 (n_bytes=4), every number checkable
  in one's head;
- the large one, B=16, N=16384, D=4096, H=32, fp16 (n_bytes=2) on the A100 SXM (2039 GB/s,
  312 TF/s tensor cores, 19.5 TF/s fp32 CUDA cores). All sizes are powers of two, so the products
  are written as powers of two:
      B*N*D     = 2^4 * 2^14 * 2^12       = 2^30 = 1,073,741,824      (one (B, N, D) tensor)
      B*H*N*N   = 2^4 * 2^5 * 2^14 * 2^14 = 2^37 = 137,438,953,472    (one (B, H, N, N) tensor)
      B*N*N*D   = 2^4 * 2^14 * 2^14 * 2^12 = 2^44
      D*D       = 2^24 = 16,777,216
  and with 2 bytes per element a (B, N, D) tensor is 2^31 B, a (B, H, N, N) one 2^38 B (275 GB:
  more than the A100's 80 GB, so these are the floors of a hypothetical unfused run).
"""

import pytest

from fastlm.analysis.transformer import (
    STAGE_COLUMNS,
    Stage,
    attention_stages,
    mha_stages,
    mha_total,
    mlp_stages,
    mlp_total,
    projection_stages,
    render_stages,
    sdpa_total,
)
from fastlm.devices import device_spec
from fastlm.utils.tables import markdown_table

A100 = device_spec("a100")
BIG = dict(B=16, N=16384, D=4096, H=32, n_bytes=2)
SMALL = dict(B=3, N=5, D=6, H=2, n_bytes=4)
BANDWIDTH = 2039e9  # A100 bytes/s
TENSOR_RATE = 312e12  # A100 FLOP/s, bf16/fp16 tensor cores
VECTOR_RATE = 19.5e12  # A100 FLOP/s, fp32 CUDA cores


def by_name(stages: list[Stage]) -> dict[str, Stage]:
    return {s.name: s for s in stages}


def without_heads(shape: dict) -> dict:
    return {k: v for k, v in shape.items() if k != "H"}


def test_small_shape_every_stage():
    # B*N*D = 90 elements (360 B), B*H*N*N = 150 (600 B), N*N = 25 (100 B), D*D = 36 (144 B), B*N*N*D = 450
    attention = by_name(attention_stages(**SMALL))
    assert [s.name for s in attention_stages(**SMALL)] == ["QK^T/sqrt(d)", "causal mask", "softmax", "AV"]
    qk, mask, softmax, av = (attention[k] for k in ("QK^T/sqrt(d)", "causal mask", "softmax", "AV"))
    assert (qk.flops, qk.bytes_read, qk.bytes_written) == (900, 720, 600)  # 2 * 450; Q, K 2 * 360; S
    assert (mask.flops, mask.bytes_read, mask.bytes_written) == (150, 700, 600)  # 1 * 150; S + mask 600 + 100
    assert (softmax.flops, softmax.bytes_read, softmax.bytes_written) == (750, 600, 600)  # 5 * 150
    assert (av.flops, av.bytes_read, av.bytes_written) == (900, 960, 360)  # P + V 600 + 360; O

    qkv, out = projection_stages(**without_heads(SMALL))
    assert (qkv.flops, qkv.bytes_read, qkv.bytes_written) == (3240, 1512, 1080)  # 3 * 2 * 90 * 6; 3 * (360 + 144)
    assert (out.flops, out.bytes_read, out.bytes_written) == (1080, 504, 360)  # 2 * 90 * 6; 360 + 144

    up, act, down = mlp_stages(**without_heads(SMALL))  # hidden (B, N, 4D) = 360 elements, 1440 B; 4D^2 = 576 B
    assert (up.flops, up.bytes_read, up.bytes_written) == (4320, 936, 1440)  # 2 * 90 * 24; 360 + 576
    assert (act.flops, act.bytes_read, act.bytes_written) == (2880, 1440, 1440)  # 8 * 360
    assert (down.flops, down.bytes_read, down.bytes_written) == (4320, 2016, 360)  # 1440 + 576

    sdpa = sdpa_total(**SMALL)
    assert (sdpa.flops, sdpa.bytes_read, sdpa.bytes_written) == (2700, 2980, 2160)
    mha = mha_total(**SMALL)
    assert [s.name for s in mha_stages(**SMALL)][0::5] == ["Q/K/V projections", "output projection"]
    assert (mha.flops, mha.bytes) == (2700 + 3240 + 1080, 5140 + 2592 + 864)
    mlp = mlp_total(**without_heads(SMALL))
    assert (mlp.flops, mlp.bytes_read, mlp.bytes_written) == (11520, 4392, 3240)


def test_big_attention_flops_and_bytes():
    s = by_name(attention_stages(**BIG))
    qk, mask, softmax, av = (s[k] for k in ("QK^T/sqrt(d)", "causal mask", "softmax", "AV"))
    assert qk.flops == 2 * 16 * 16384**2 * 4096 == 2**45 == 35_184_372_088_832  # ≈ 3.52e13
    assert qk.bytes_read == 2 * 2**31 == 4_294_967_296  # Q and K
    assert qk.bytes_written == 16 * 32 * 16384**2 * 2 == 2**38 == 274_877_906_944  # S
    assert qk.bytes == 2**32 + 2**38 == 279_172_874_240

    assert mask.flops == 2**37 == 137_438_953_472  # one add per score
    assert mask.bytes_read == 2**38 + 16384**2 * 2 == 275_414_777_856  # S + the (N, N) mask, 2^29 B
    assert mask.bytes == 2**39 + 2**29 == 550_292_684_800

    assert softmax.flops == 5 * 2**37 == 687_194_767_360
    assert softmax.bytes == 2 * 2**38 == 549_755_813_888  # S in, P out

    assert av.flops == 2**45
    assert (av.bytes_read, av.bytes_written) == (2**38 + 2**31, 2**31)  # P + V; O
    assert av.bytes == qk.bytes  # same traffic mirrored: 2 small in + 1 big out vs 1 big + 1 small in + 1 small out

    sdpa = sdpa_total(**BIG)
    assert sdpa.flops == 2**46 + 2**37 + 5 * 2**37 == 71_193_377_898_496
    assert sdpa.bytes == 2 * (2**32 + 2**38) + (2**39 + 2**29) + 2**39 == 1_658_394_247_168


def test_big_projection_and_mlp_flops_and_bytes():
    qkv, out = projection_stages(**without_heads(BIG))
    assert qkv.flops == 3 * 2 * 2**30 * 4096 == 26_388_279_066_624  # 3 * 2BND^2
    assert qkv.bytes_read == 3 * (2**31 + 2**25) == 6_543_114_240  # X three times + three D x D weights
    assert qkv.bytes_written == 3 * 2**31 == 6_442_450_944
    assert out.flops == 2**43 == 8_796_093_022_208
    assert out.bytes == 2**31 + 2**25 + 2**31 == 4_328_521_728

    up, act, down = mlp_stages(**without_heads(BIG))
    assert up.flops == down.flops == 2 * 2**30 * 4 * 4096 == 2**45  # 2 * BND * 4D
    assert (up.bytes_read, up.bytes_written) == (2**31 + 4 * 2**25, 4 * 2**31)  # X + W_up; hidden 2^33 B
    assert (down.bytes_read, down.bytes_written) == (4 * 2**31 + 4 * 2**25, 2**31)
    assert up.bytes == down.bytes == 10_871_635_968
    assert act.flops == 8 * 4 * 2**30 == 34_359_738_368  # 8 per element of the (B, N, 4D) hidden
    assert act.bytes == 2 * 2**33 == 17_179_869_184

    mlp = mlp_total(**without_heads(BIG))
    assert mlp.flops == 2**46 + 2**35 == 70_403_103_916_032
    assert mlp.bytes == 2 * 10_871_635_968 + 2**34 == 38_923_141_120

    mha = mha_total(**BIG)
    assert mha.flops == 71_193_377_898_496 + 26_388_279_066_624 + 8_796_093_022_208 == 106_377_749_987_328
    assert mha.bytes == 1_658_394_247_168 + 12_985_565_184 + 4_328_521_728 == 1_675_708_334_080


def test_big_verdicts_on_a100():
    assert A100.ridge_flops_per_byte == pytest.approx(TENSOR_RATE / BANDWIDTH)  # 153.0 FLOP/B
    assert A100.vector_ridge_flops_per_byte == pytest.approx(VECTOR_RATE / BANDWIDTH)  # 9.56 FLOP/B
    s = by_name(mha_stages(**BIG) + mlp_stages(**without_heads(BIG)))

    # QK^T with materialized scores: 2BN^2D / (n (2BND + BHN^2)) = 2ND / (n (2D + HN))
    #   = 2 * 16384 * 4096 / (2 * (8192 + 524288)) = 2^13 / 65 = 126.03 < 153: memory-bound.
    # Writing S dominates; as N grows the intensity only rises to 2D / (H n) = head dim 128 (fp16).
    qk = s["QK^T/sqrt(d)"]
    assert qk.intensity == pytest.approx(2**13 / 65) == pytest.approx(126.0308, abs=1e-4)
    assert qk.verdict(A100) == "memory-bound"
    assert qk.min_time_s(A100) == pytest.approx(279_172_874_240 / BANDWIDTH)  # 136.9 ms, not 2^45 / 312e12 = 112.8
    assert s["AV"].intensity == pytest.approx(2**13 / 65)
    assert s["AV"].verdict(A100) == "memory-bound"

    # Elementwise stages against the CUDA-core ridge 9.56: 1/4, 5/4 and 2 FLOP/B.
    assert s["causal mask"].intensity == pytest.approx(2**37 / (2**39 + 2**29)) == pytest.approx(0.2498, abs=1e-4)
    assert s["softmax"].intensity == pytest.approx(1.25)  # 5 FLOPs per 4 bytes (2 in, 2 out)
    assert s["activation"].intensity == pytest.approx(2.0)  # 8 FLOPs per 4 bytes
    for name in ("causal mask", "softmax", "activation"):
        assert s[name].verdict(A100) == "memory-bound"
    assert s["causal mask"].min_time_s(A100) == pytest.approx(550_292_684_800 / BANDWIDTH)  # 269.9 ms
    assert s["softmax"].min_time_s(A100) == pytest.approx(549_755_813_888 / BANDWIDTH)  # 269.6 ms
    assert s["activation"].min_time_s(A100) == pytest.approx(17_179_869_184 / BANDWIDTH)  # 8.43 ms

    # Weight matmuls: intensity ~ thousands, far above 153; the floor is FLOPs / 312 TF/s.
    assert s["Q/K/V projections"].intensity == pytest.approx(26_388_279_066_624 / 12_985_565_184)  # 2032
    assert s["up projection"].intensity == pytest.approx(2**45 / 10_871_635_968)  # 3236
    for name in ("Q/K/V projections", "output projection", "up projection", "down projection"):
        assert s[name].verdict(A100) == "compute-bound"
    assert s["Q/K/V projections"].min_time_s(A100) == pytest.approx(26_388_279_066_624 / TENSOR_RATE)  # 84.6 ms
    assert s["up projection"].min_time_s(A100) == pytest.approx(2**45 / TENSOR_RATE)  # 112.8 ms

    mlp, sdpa, mha = mlp_total(**without_heads(BIG)), sdpa_total(**BIG), mha_total(**BIG)
    assert mlp.intensity == pytest.approx(1808.77, abs=0.01)
    assert mlp.verdict(A100) == "compute-bound"
    assert mlp.min_time_s(A100) == pytest.approx(70_403_103_916_032 / TENSOR_RATE)  # 225.7 ms
    assert sdpa.intensity == pytest.approx(42.93, abs=0.01)
    assert sdpa.verdict(A100) == "memory-bound"
    assert sdpa.min_time_s(A100) == pytest.approx(1_658_394_247_168 / BANDWIDTH)  # 813.3 ms
    assert mha.intensity == pytest.approx(63.48, abs=0.01)
    assert mha.verdict(A100) == "memory-bound"


def test_min_time_uses_the_rate_of_the_unit_doing_the_math():
    # 1e12 FLOPs over 1e9 bytes: 1000 FLOP/B, above both ridges; the elementwise version waits on
    # the 19.5 TF/s CUDA cores, the matmul one on the 312 TF/s tensor cores.
    vector = Stage("x", 10**12, 10**9, 0, matmul=False, scaling="N")
    tensor = Stage("x", 10**12, 10**9, 0, matmul=True, scaling="N")
    assert vector.min_time_s(A100) == pytest.approx(1e12 / VECTOR_RATE)
    assert tensor.min_time_s(A100) == pytest.approx(1e12 / TENSOR_RATE)
    # 100 FLOP/B: memory-bound against the tensor-core ridge 153, compute-bound against 9.56
    middle = dict(flops=10**11, bytes_read=10**9, bytes_written=0, scaling="N")
    assert Stage("x", matmul=True, **middle).verdict(A100) == "memory-bound"
    assert Stage("x", matmul=False, **middle).verdict(A100) == "compute-bound"


def test_doubling_n_scales_scores_quadratically_and_the_rest_linearly():
    doubled = dict(BIG, N=2 * BIG["N"])
    for stages, stages_2n in [
        (mha_stages(**BIG), mha_stages(**doubled)),
        (mlp_stages(**without_heads(BIG)), mlp_stages(**without_heads(doubled))),
        (
            [sdpa_total(**BIG), mlp_total(**without_heads(BIG))],
            [sdpa_total(**doubled), mlp_total(**without_heads(doubled))],
        ),
    ]:
        for s, s2 in zip(stages, stages_2n, strict=True):
            factor = 4 if s.scaling == "N^2" else 2
            assert s2.flops == factor * s.flops, s.name
            # bytes carry smaller terms that grow slower (weights, Q/K/V next to S): within 3%
            assert 0.97 * factor * s.bytes < s2.bytes <= factor * s.bytes, s.name
    scaling = {s.name: s.scaling for s in mha_stages(**BIG) + mlp_stages(**without_heads(BIG))}
    assert {name for name, how in scaling.items() if how == "N^2"} == {"QK^T/sqrt(d)", "causal mask", "softmax", "AV"}
    assert sdpa_total(**BIG).scaling == mha_total(**BIG).scaling == "N^2"
    # A total mixing both kinds is labelled by its leading term: at N = 16384 the projections'
    # 3.5e13 FLOPs still weigh against SDPA's 7.1e13, so doubling N multiplies the MHA by
    # (4 * 71,193,377,898,496 + 2 * 35,184,372,088,832) / 106,377,749,987,328 = 3.34, not 4.
    mha, mha_2n = mha_total(**BIG), mha_total(**doubled)
    assert mha_2n.flops == 4 * 71_193_377_898_496 + 2 * 35_184_372_088_832
    assert mha_2n.flops / mha.flops == pytest.approx(3.3385, abs=1e-4)
    assert mlp_total(**without_heads(BIG)).scaling == "N"


@pytest.mark.parametrize(
    ("shape", "message"),
    [
        (dict(SMALL, D=7), "D must be divisible by H"),
        (dict(SMALL, N=0), "N must be a positive integer, got 0"),
        (dict(SMALL, B=-1), "B must be a positive integer, got -1"),
        (dict(SMALL, H=0), "H must be a positive integer"),
        (dict(SMALL, D=6.0), "D must be a positive integer"),
        (dict(SMALL, n_bytes=3), "n_bytes must be one of 1 \\(fp8\\), 2 \\(fp16/bf16\\), 4 \\(fp32\\), got 3"),
    ],
)
def test_bad_arguments(shape, message):
    for function in (attention_stages, sdpa_total, mha_stages, mha_total):
        with pytest.raises(ValueError, match=message):
            function(**shape)
    if "H" not in message and "divisible" not in message:
        for function in (projection_stages, mlp_stages, mlp_total):
            with pytest.raises(ValueError, match=message):
                function(**without_heads(shape))


def test_bad_scaling_label():
    with pytest.raises(ValueError, match="scaling must be one of N, N\\^2"):
        Stage("x", 1, 1, 1, matmul=True, scaling="N^3")


def test_render_stages():
    rows = render_stages([*attention_stages(**BIG), mlp_total(**without_heads(BIG))], A100)
    assert [set(row) for row in rows] == [{key for key, _ in STAGE_COLUMNS}] * 5
    qk, mlp = rows[0], rows[-1]
    assert qk["stage"] == "QK^T/sqrt(d)"
    assert (qk["flops"], qk["bytes"], qk["verdict"], qk["scaling"]) == (2**45, 2**32 + 2**38, "memory-bound", "N^2")
    assert qk["intensity"] == pytest.approx(2**13 / 65)
    assert qk["min_time_us"] == pytest.approx(279_172_874_240 / BANDWIDTH * 1e6)  # 136,916.6 µs
    assert (mlp["stage"], mlp["verdict"], mlp["scaling"]) == ("MLP", "compute-bound", "N")
    table = markdown_table(rows, STAGE_COLUMNS)
    assert table.splitlines()[0] == "| stage | FLOPs | bytes | FLOP/B | bound | min time (µs) | scales as |"
    assert len(table.splitlines()) == 2 + 5
