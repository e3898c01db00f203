"""Parallel-training accounting pinned to values computed by hand, plus properties and the command.

The default config, D = 16384 = 2^14, F = 53248 = 2^12 * 13, 126 blocks, 8192 = 2^13 tokens:
    P          = 2 * 126 * 2^14 * 2^12 * 13 = 2^27 * 1638 = 2^28 * 819 = 219,848,638,464
    4 * P      = 879,394,553,856 B          (master weights; gradients the same)
    8 * P      = 1,758,789,107,712 B        (AdamW m and v)
    16 * P     = 2^32 * 819 = 3,517,578,215,424 B
    per token  = 2 B * 126 * (2^14 + 2^12 * 13) = 2 * 126 * 69,632 = 17,547,264 B
    A          = 2^13 * 17,547,264 = 143,747,186,688 B,  A/2 = 71,873,593,344 B
    16 * P + A = 3,661,325,402,112 B
80 GB GPUs: 3,517.58 / 80 = 43.97 -> 44 for the state, 3,661.33 / 80 = 45.77 -> 46 with A.
FSDP, limit 95 GB = 95e9 B:
    M(N) = (16 * P + A/2) / N + A/2 = 3,589,451,808,768 / N + 71,873,593,344
    M(N) < 95e9  <=>  N > 3,589,451,808,768 / 23,126,406,656 = 155.21  ->  N = 156
    M(156) = 23,009,306,466.46 + 71,873,593,344 = 94,882,899,810.46 B
    M(155) = 23,157,753,604.95 + 71,873,593,344 = 95,031,346,948.95 B
TPU v5p mesh, X = 16, Y = 4, N = 64, M_X = 2, M_Y = 1, alpha = C / W = 4.6e14 / 1.8e11 = 23000 / 9:
    B* = alpha F X / (M_X (F - alpha Y / M_Y))
       = (23000 / 9) * 53248 * 16 / (2 * (53248 - 92000 / 9))
       = 23000 * 53248 * 8 / (479,232 - 92,000) = 9,797,632,000 / 387,232 = 306,176,000 / 12,101 = 25,301.71
    B* / N = 4,784,000 / 12,101 = 395.34 tokens per device (396 whole tokens, 25,344 in all)
    T_FSDP = 4 D F / (Y W M_X) = 4 * 2^14 * 53248 / (4 * 1.8e11 * 2) = 3,489,660,928 / 1.44e12 = 2.4234 ms
"""

import math

import pytest

from fastlm.analysis.parallel import (
    MeshConfig,
    ParallelConfig,
    compute_bound_batch,
    devices_needed,
    forward_times,
    fsdp_memory_per_device,
    memory_accounting,
    smallest_fsdp_degree,
)
from fastlm.cli import main

DEFAULT = ParallelConfig()
V5P = MeshConfig()
STATE = 3_517_578_215_424  # 16 * P
HALF_A = 71_873_593_344  # A / 2


def test_default_memory_accounting():
    memory = memory_accounting(DEFAULT)
    assert memory.parameters == 219_848_638_464
    assert memory.master_weights == memory.gradients == 879_394_553_856
    assert memory.adamw_state == 1_758_789_107_712
    assert memory.state == STATE
    assert memory.activations_per_token == 17_547_264
    assert memory.activations == 2 * HALF_A == 143_747_186_688
    assert memory.total == 3_661_325_402_112
    assert devices_needed(memory.state, 80) == 44
    assert devices_needed(memory.total, 80) == 46


def test_default_fsdp_degree():
    assert fsdp_memory_per_device(DEFAULT, 156) == pytest.approx(94_882_899_810.46, abs=0.01)
    assert fsdp_memory_per_device(DEFAULT, 155) == pytest.approx(95_031_346_948.95, abs=0.01)
    assert fsdp_memory_per_device(DEFAULT, 1) == STATE + 2 * HALF_A  # nothing sharded away: the whole replica
    assert smallest_fsdp_degree(DEFAULT, 95) == 156


def test_default_compute_bound_batch():
    batch = compute_bound_batch(DEFAULT, V5P)
    assert batch == pytest.approx(306_176_000 / 12_101, rel=1e-12)  # 25,301.71 tokens
    assert batch / V5P.devices == pytest.approx(4_784_000 / 12_101, rel=1e-12)  # 395.34 per device
    times = forward_times(DEFAULT, V5P, batch)
    assert times.fsdp_comms_s == pytest.approx(3_489_660_928 / 1.44e12, rel=1e-12)
    assert times.math_s == pytest.approx(times.comms_s, rel=1e-12)  # the threshold is where they meet


def test_tiny_config_by_hand_with_an_exact_boundary():
    # D = F = blocks = tokens = 1: P = 2, 16 * P = 32 B, A = 2 * 1 * (1 + 1) = 4 B, M(N) = 34 / N + 2
    tiny = ParallelConfig(d_model=1, d_ff=1, blocks=1, batch=1, context_length=1)
    assert [fsdp_memory_per_device(tiny, n) for n in (1, 2, 17)] == [36, 19, 4]
    assert smallest_fsdp_degree(tiny, 19e-9) == 3  # M(2) = 19 B is not under 19 B
    assert smallest_fsdp_degree(tiny, 19.5e-9) == 2
    assert smallest_fsdp_degree(tiny, 37e-9) == 1
    assert smallest_fsdp_degree(tiny, 2e-9) is None  # A/2 = 2 B is replicated on every device
    assert devices_needed(36, 36e-9) == 1 and devices_needed(37, 36e-9) == 2


CONFIGS = [
    DEFAULT,
    ParallelConfig(d_model=4096, d_ff=14336, blocks=32, batch=4, context_length=4096),  # 7B-like
    ParallelConfig(d_model=8192, d_ff=28672, blocks=80, batch=2, context_length=8192),  # 70B-like
    ParallelConfig(d_model=3, d_ff=7, blocks=5, batch=11, context_length=13),  # small primes
]


@pytest.mark.parametrize("config", CONFIGS)
def test_memory_per_device_falls_with_n_towards_half_the_activations(config):
    per_device = [fsdp_memory_per_device(config, n) for n in (1, 2, 3, 8, 64, 1000, 10**6)]
    assert all(a > b for a, b in zip(per_device, per_device[1:], strict=False))
    half = memory_accounting(config).activations / 2
    assert per_device[-1] > half and per_device[-1] == pytest.approx(half, rel=1e-3)


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("fraction", [0.05, 0.3, 0.7, 0.999])
def test_smallest_fsdp_degree_is_the_first_that_fits(config, fraction):
    # limits between A/2 and the whole replica, and exactly at M(n) for some n (a boundary)
    memory = memory_accounting(config)
    half = memory.activations / 2
    for limit_bytes in (half + fraction * (memory.total - half), fsdp_memory_per_device(config, 7)):
        limit_gb = limit_bytes / 1e9
        n = smallest_fsdp_degree(config, limit_gb)
        assert fsdp_memory_per_device(config, n) < limit_gb * 1e9
        assert n == 1 or fsdp_memory_per_device(config, n - 1) >= limit_gb * 1e9


def test_compute_bound_batch_is_the_threshold():
    for mesh in (V5P, MeshConfig(x=64, y=8), MeshConfig(m_x=1, m_y=2, x=32, y=16), MeshConfig(x=3, y=5)):
        batch = compute_bound_batch(DEFAULT, mesh)
        assert forward_times(DEFAULT, mesh, batch * 1.001).compute_bound
        assert not forward_times(DEFAULT, mesh, batch * 0.999).compute_bound
        # the book's closed form, alpha F X / (M_X (F - alpha Y / M_Y))
        alpha, f = mesh.ici_intensity, DEFAULT.d_ff
        assert batch == pytest.approx(alpha * f * mesh.x / (mesh.m_x * (f - alpha * mesh.y / mesh.m_y)), rel=1e-12)


def test_no_split_of_64_chips_beats_the_books_bound():
    # with the best real-valued X the book finds B / N > 4 alpha^2 / (F M_X M_Y) = 245.3 at M_X = 2, M_Y = 1
    alpha, f = V5P.ici_intensity, DEFAULT.d_ff
    bound = 4 * alpha**2 / (f * V5P.m_x * V5P.m_y)
    per_device = [compute_bound_batch(DEFAULT, MeshConfig(x=64 // y, y=y)) / 64 for y in (1, 2, 4, 8, 16)]
    assert min(per_device) > bound
    assert min(per_device) < 1.1 * bound  # X = 32, Y = 2 is close to the book's optimum (X = 30.3)


def test_no_batch_is_compute_bound_past_the_tp_limit():
    # the bracket F / (N C) - 1 / (X W M_Y) is positive iff F > alpha Y / M_Y: 53248 vs 2555.6 Y
    assert compute_bound_batch(DEFAULT, MeshConfig(y=20)) is not None  # 51,111 < 53,248
    assert compute_bound_batch(DEFAULT, MeshConfig(y=21)) is None  # 53,667 >= 53,248
    assert compute_bound_batch(DEFAULT, MeshConfig(y=21, m_y=2)) is not None  # two axes halve T_TP


def test_blocks_and_tokens_do_not_change_the_compute_bound_batch():
    other = ParallelConfig(blocks=7, batch=3, context_length=5)
    assert compute_bound_batch(other, V5P) == compute_bound_batch(DEFAULT, V5P)


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: ParallelConfig(d_model=0), "d_model must be a positive integer"),
        (lambda: ParallelConfig(d_ff=-1), "d_ff must be a positive integer"),
        (lambda: ParallelConfig(blocks=1.5), "blocks must be a positive integer"),
        (lambda: ParallelConfig(batch=True), "batch must be a positive integer"),
        (lambda: ParallelConfig(context_length=0), "context_length must be a positive integer"),
        (lambda: MeshConfig(w_ici=0), "w_ici must be a positive finite number"),
        (lambda: MeshConfig(flops=math.nan), "flops must be a positive finite number"),
        (lambda: MeshConfig(flops=math.inf), "flops must be a positive finite number"),
        (lambda: MeshConfig(m_x=0), "m_x must be a positive integer"),
        (lambda: MeshConfig(y=2.0), "y must be a positive integer"),
        (lambda: devices_needed(0, 80), "total_bytes must be a positive integer"),
        (lambda: devices_needed(10, -80), "device_memory_gb must be a positive finite number"),
        (lambda: fsdp_memory_per_device(DEFAULT, 0), "n_fsdp must be a positive integer"),
        (lambda: smallest_fsdp_degree(DEFAULT, 0), "device_memory_gb must be a positive finite number"),
        (lambda: forward_times(DEFAULT, V5P, -1), "batch_tokens must be a positive finite number"),
    ],
)
def test_bad_arguments_raise(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_analyze_parallel_command(capsys):
    assert main(["analyze", "parallel"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    for expected in (
        "219,848,638,464",
        "3,517.58 GB",
        "17,547,264 B",
        "143.75 GB",
        "3,661.33 GB",
        "80 GB GPUs to hold it: 44 for weights, gradients and AdamW state, 46 with the saved",
        "94.88 GB",
        "95.03 GB",
        "Smallest N_FSDP with per-device memory under 95 GB: 156",
        "25,301.7 tokens",
        "395.3 tokens",
        "396 (25,344 in all)",
        "2,423.4 µs",
    ):
        assert expected in out, expected
    # more tokens than 2 x 95 GB of activations: no N fits; 21-way TP on one axis: no batch is compute-bound
    assert main(["analyze", "parallel", "--batch", "2", "--context", "8192", "--y", "21", "--x", "3"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "No N_FSDP fits under 95 GB" in out and "No batch is compute-bound" in out
    assert (
        main(
            [
                "analyze",
                "parallel",
                "--device-memory-gb",
                "1e6",
                "--gpu-memory-gb",
                "141",
                "--d-model",
                "8192",
                "--d-ff",
                "28672",
                "--blocks",
                "80",
                "--w-ici",
                "9e10",
                "--flops",
                "9.89e14",
                "--mx",
                "1",
                "--my",
                "2",
            ]
        )
        == 0
    )
    out = " ".join(capsys.readouterr().out.split())
    assert "Smallest N_FSDP with per-device memory under 1e+06 GB: 1 " in out and "141 GB GPUs" in out


@pytest.mark.parametrize(
    "argv",
    [
        ["analyze", "parallel", "--x", "0"],
        ["analyze", "parallel", "--flops", "nan"],
        ["analyze", "parallel", "--w-ici", "inf"],
        ["analyze", "parallel", "--device-memory-gb", "-95"],
        ["analyze", "parallel", "--d-model", "16k"],
    ],
)
def test_bad_flags_exit_with_one_clear_error(argv, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert "error: argument --" in capsys.readouterr().err
