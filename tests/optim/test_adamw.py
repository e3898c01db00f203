"""fastlm.optim.AdamW against torch.optim.AdamW: updates, states, state dicts, errors.

The kernel runs on the `device` fixture's device: CUDA when present, else the CPU under the Triton
interpreter (tests/conftest.py sets TRITON_INTERPRET=1). Every comparison runs both optimizers on
copies of the same parameters with the same gradients.
"""

import copy
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastlm.optim import AdamW, AdamWConfig, adamw_config
from fastlm.optim import adamw as adamw_module

# 16-element blocks: tensors span several programs, full blocks next to partial ones
SMALL_BLOCKS = AdamWConfig(block=16, num_warps=1)
# 1 element; a prime below the block; 15 (one partial block); exactly one block; just above two
# blocks; a 3-d tensor of 72 (four full blocks and a partial one)
SHAPES = [(1,), (7,), (3, 5), (16,), (33,), (4, 9, 2)]
# (rtol, atol): a few fp32 roundings of the values' scale (torch's lerp may fuse its multiply-add,
# the kernel's too on a GPU). Params ~1 moved by ~lr; exp_avg ~g ~1, but cancellation can leave it
# far smaller than its rounding errors; exp_avg_sq ~(1 - beta2) g^2 ~1e-3; step counts exact.
TOLERANCES = {"param": (1e-6, 1e-7), "exp_avg": (1e-5, 1e-7), "exp_avg_sq": (1e-5, 1e-9), "step": (0, 0)}


def make_params(shapes, device, dtype=torch.float32) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(torch.randn(shape, dtype=dtype, device=device)) for shape in shapes]


def clone_params(params) -> list[torch.nn.Parameter]:
    return [torch.nn.Parameter(p.detach().clone()) for p in params]


def two_groups(params, **second_group) -> list[dict]:
    """The first half of ``params`` at the optimizer's defaults, the rest with ``second_group``."""
    half = len(params) // 2
    return [{"params": params[:half]}, {"params": params[half:], **second_group}]


def set_grads(ours, theirs, skip=()) -> None:
    """Fresh random gradients, the same for both lists; indices in ``skip`` get None."""
    for i, (p, q) in enumerate(zip(ours, theirs, strict=True)):
        grad = None if i in skip else torch.randn_like(p)
        p.grad, q.grad = grad, (None if grad is None else grad.clone())


def step_both(ours_opt, theirs_opt, ours, theirs, steps: int) -> None:
    """``steps`` steps of both optimizers, each after fresh gradients."""
    for _ in range(steps):
        set_grads(ours, theirs)
        ours_opt.step()
        theirs_opt.step()


def assert_same_state(ours_opt, theirs_opt, ours, theirs) -> None:
    for p, q in zip(ours, theirs, strict=True):
        rtol, atol = TOLERANCES["param"]
        torch.testing.assert_close(p, q, rtol=rtol, atol=atol)
        assert ours_opt.state[p].keys() == theirs_opt.state[q].keys()
        for key in ours_opt.state[p]:
            got, want = ours_opt.state[p][key], theirs_opt.state[q][key]
            assert (got.dtype, got.device) == (want.dtype, want.device), key
            rtol, atol = TOLERANCES[key]
            torch.testing.assert_close(got, want, rtol=rtol, atol=atol)


@pytest.mark.parametrize("config", [SMALL_BLOCKS, None], ids=["16-element blocks", "default blocks"])
@pytest.mark.parametrize("weight_decay", [0.0, 0.1])
def test_matches_torch_adamw_over_steps(config, weight_decay, device):
    ours = make_params(SHAPES, device)
    theirs = clone_params(ours)
    second = {"lr": 3e-3, "betas": (0.8, 0.99)}  # a second group with its own hyper-parameters
    ours_opt = AdamW(two_groups(ours, **second), lr=1e-2, weight_decay=weight_decay, config=config)
    theirs_opt = torch.optim.AdamW(two_groups(theirs, **second), lr=1e-2, weight_decay=weight_decay, foreach=False)
    initial = [p.detach().clone() for p in ours]
    step_both(ours_opt, theirs_opt, ours, theirs, steps=4)
    assert_same_state(ours_opt, theirs_opt, ours, theirs)
    assert all(not torch.equal(p, p0) for p, p0 in zip(ours, initial, strict=True))  # every element moved


def test_none_gradients_and_step_counts_that_differ(device):
    # parameter 1 has no gradient at step 1: no state and no update then, and afterwards its step
    # count lags the others', so its group takes two launches with different bias corrections
    ours = make_params(SHAPES, device)
    theirs = clone_params(ours)
    ours_opt = AdamW(ours, lr=1e-2, config=SMALL_BLOCKS)
    theirs_opt = torch.optim.AdamW(theirs, lr=1e-2, foreach=False)
    set_grads(ours, theirs, skip={1})
    before = ours[1].detach().clone()
    ours_opt.step()
    theirs_opt.step()
    assert torch.equal(ours[1], before) and ours[1] not in ours_opt.state
    step_both(ours_opt, theirs_opt, ours, theirs, steps=2)
    assert ours_opt.state[ours[1]]["step"].item() == 2 and ours_opt.state[ours[0]]["step"].item() == 3
    assert_same_state(ours_opt, theirs_opt, ours, theirs)
    ours_opt.zero_grad()
    theirs_opt.zero_grad()
    ours_opt.step()  # no gradient anywhere: nothing changes
    assert_same_state(ours_opt, theirs_opt, ours, theirs)


def test_tables_are_rebuilt_only_when_addresses_change(monkeypatch, device):
    builds = []
    build = adamw_module._build_tables
    monkeypatch.setattr(adamw_module, "_build_tables", lambda *args: builds.append(1) or build(*args))
    ours = make_params(SHAPES, device)
    theirs = clone_params(ours)
    ours_opt = AdamW(ours, lr=1e-2, config=SMALL_BLOCKS)
    theirs_opt = torch.optim.AdamW(theirs, lr=1e-2, foreach=False)
    set_grads(ours, theirs)
    for _ in range(3):  # gradients written in place, as zero_grad(set_to_none=False) and backward do
        ours_opt.step()
        theirs_opt.step()
        for p, q in zip(ours, theirs, strict=True):
            p.grad.copy_(torch.randn_like(p))
            q.grad.copy_(p.grad)
    assert len(builds) == 1
    # new gradient tensors (the old ones kept alive, so the addresses differ), then a parameter
    # moved to new memory: stale tables would leave these tensors' updates wrong
    old_grads = [p.grad for p in ours]
    set_grads(ours, theirs)
    ours_opt.step()
    theirs_opt.step()
    assert len(builds) == 2
    assert_same_state(ours_opt, theirs_opt, ours, theirs)
    ours[2].data = ours[2].data.clone()
    theirs[2].data = theirs[2].data.clone()
    ours_opt.step()
    theirs_opt.step()
    assert len(builds) == 3
    assert_same_state(ours_opt, theirs_opt, ours, theirs)
    del old_grads


def test_kernel_takes_only_aligned_contiguous_fp32(device):
    def takes(param):
        state = {"exp_avg": torch.zeros_like(param), "exp_avg_sq": torch.zeros_like(param)}
        return adamw_module._kernel_takes(param, torch.randn_like(param), state)

    assert takes(torch.randn(10, device=device))
    assert not takes(torch.randn(10, dtype=torch.float64, device=device))
    assert not takes(torch.randn(10, dtype=torch.bfloat16, device=device))
    assert not takes(torch.randn(6, 4, device=device).t())  # non-contiguous
    assert not takes(torch.randn(11, device=device)[1:])  # 4 bytes past an aligned address: no 16-byte accesses


def test_groups_the_kernel_does_not_take_match_torch(device):
    # fp64 and non-contiguous parameters (torch's path) next to fp32 ones (the kernel's) in one group
    ours = [
        *make_params([(5,), (3, 4)], device),
        *make_params([(6,)], device, torch.float64),
        torch.nn.Parameter(torch.randn(6, 4, device=device).t()),
    ]
    theirs = clone_params(ours)
    ours_opt = AdamW(ours, lr=1e-2, config=SMALL_BLOCKS)
    theirs_opt = torch.optim.AdamW(theirs, lr=1e-2, foreach=False)
    step_both(ours_opt, theirs_opt, ours, theirs, steps=3)
    assert_same_state(ours_opt, theirs_opt, ours, theirs)


def test_cpu_without_the_interpreter_takes_torchs_path(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    ours = make_params(SHAPES, "cpu")
    theirs = clone_params(ours)
    ours_opt = AdamW(two_groups(ours, lr=3e-3), lr=1e-2)
    theirs_opt = torch.optim.AdamW(two_groups(theirs, lr=3e-3), lr=1e-2, foreach=False)
    step_both(ours_opt, theirs_opt, ours, theirs, steps=3)
    assert_same_state(ours_opt, theirs_opt, ours, theirs)


def test_state_dict_round_trip_with_torch(device):
    ours = make_params(SHAPES, device)
    theirs = clone_params(ours)
    ours_opt = AdamW(two_groups(ours, lr=3e-3), lr=1e-2, config=SMALL_BLOCKS)
    for _ in range(3):
        set_grads(ours, theirs)
        ours_opt.step()
    for p, q in zip(ours, theirs, strict=True):
        q.data.copy_(p)
    # ours -> torch: both go on from the same state and stay equal
    theirs_opt = torch.optim.AdamW(two_groups(theirs), foreach=False)
    theirs_opt.load_state_dict(copy.deepcopy(ours_opt.state_dict()))
    assert theirs_opt.param_groups[1]["lr"] == 3e-3 and theirs_opt.param_groups[0]["decoupled_weight_decay"]
    step_both(ours_opt, theirs_opt, ours, theirs, steps=2)
    assert_same_state(ours_opt, theirs_opt, ours, theirs)
    # torch -> ours: a fresh optimizer takes torch's state, drops its implementation flags
    fresh_opt = AdamW(two_groups(ours), config=SMALL_BLOCKS)
    fresh_opt.load_state_dict(copy.deepcopy(theirs_opt.state_dict()))
    assert "foreach" not in fresh_opt.param_groups[0] and fresh_opt.param_groups[1]["lr"] == 3e-3
    step_both(fresh_opt, theirs_opt, ours, theirs, steps=1)
    assert_same_state(fresh_opt, theirs_opt, ours, theirs)


def test_loaded_step_counts_move_to_the_cpu():
    # torch's fused and capturable AdamW keep step on the parameters' device, older checkpoints a number
    params = make_params([(4,), (3,)], "cpu")
    opt = AdamW(params)
    state = {
        "state": {
            0: {"step": torch.tensor(5.0, dtype=torch.float64), "exp_avg": torch.randn(4), "exp_avg_sq": torch.rand(4)},
            1: {"step": 5, "exp_avg": torch.randn(3), "exp_avg_sq": torch.rand(3)},
        },
        "param_groups": [{**opt.defaults, "fused": True, "params": [0, 1]}],
    }
    opt.load_state_dict(state)
    assert "fused" not in opt.param_groups[0]
    for p in params:
        step = opt.state[p]["step"]
        assert (step.item(), step.dtype, step.device.type) == (5.0, torch.float32, "cpu")


def test_lr_as_a_cpu_tensor_under_a_scheduler(device):
    ours = make_params(SHAPES, device)
    theirs = clone_params(ours)
    ours_opt = AdamW(ours, lr=torch.tensor(1e-2), config=SMALL_BLOCKS)
    theirs_opt = torch.optim.AdamW(theirs, lr=1e-2, foreach=False)
    schedulers = [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5) for opt in (ours_opt, theirs_opt)]
    for _ in range(3):
        set_grads(ours, theirs)
        for opt, scheduler in zip((ours_opt, theirs_opt), schedulers, strict=True):
            opt.step()
            scheduler.step()
    torch.testing.assert_close(ours_opt.param_groups[0]["lr"], torch.tensor(1e-2 / 8))  # updated in place
    assert_same_state(ours_opt, theirs_opt, ours, theirs)


def test_step_returns_the_closures_loss(device):
    param = torch.nn.Parameter(torch.tensor([1.5, -0.5, 2.0, -3.0, 0.25], device=device))
    opt = AdamW([param])

    def closure():
        opt.zero_grad()
        loss = param.square().sum()
        loss.backward()
        return loss

    before = param.detach().clone()
    loss = opt.step(closure)
    torch.testing.assert_close(loss, before.square().sum())
    # first step: m / sqrt(v) with both bias-corrected is sign(g), so each element moves by lr = 1e-3
    # (the decay moves it by 1e-5 * p); the gradient 2p points away from 0
    torch.testing.assert_close(param.detach(), before * (1 - 1e-5) - 1e-3 * before.sign(), rtol=0, atol=1e-6)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"lr": -1e-3}, "lr must be >= 0"),
        ({"lr": torch.tensor([1e-3, 1e-3])}, "lr must be a float or a one-element CPU tensor"),
        ({"lr": torch.tensor(1e-3, device="meta")}, "lr must be a float or a one-element CPU tensor"),  # not on the CPU
        ({"betas": (1.0, 0.999)}, r"betas\[0\] must be in \[0, 1\)"),
        ({"betas": (0.9, -0.1)}, r"betas\[1\] must be in \[0, 1\)"),
        ({"betas": (0.9,)}, "betas must be a pair"),
        ({"eps": -1e-8}, "eps must be >= 0"),
        ({"weight_decay": -0.1}, "weight_decay must be >= 0"),
        ({"amsgrad": True}, "amsgrad=True is not supported"),
        ({"maximize": True}, "maximize=True is not supported"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AdamW([torch.nn.Parameter(torch.randn(3))], **kwargs)


def test_bad_groups_gradients_and_states_are_refused():
    param = torch.nn.Parameter(torch.randn(3))
    opt = AdamW([param])
    with pytest.raises(ValueError, match="lr must be >= 0"):
        opt.add_param_group({"params": [torch.nn.Parameter(torch.randn(2))], "lr": -1.0})
    assert len(opt.param_groups) == 1
    amsgrad_state = torch.optim.AdamW([torch.nn.Parameter(torch.randn(3))], amsgrad=True).state_dict()
    with pytest.raises(ValueError, match="amsgrad=True is not supported"):
        opt.load_state_dict(amsgrad_state)
    param.grad = torch.randn(3).to_sparse()
    with pytest.raises(RuntimeError, match="does not support sparse gradients"):
        opt.step()


def test_config_for_every_architecture():
    for arch in (0, 75, 80, 90, 100, 120):  # the interpreter (0), and unmeasured GPUs, get the default
        config = adamw_config(arch, torch.float32)
        assert config.block >= 1 and config.block & (config.block - 1) == 0 and config.num_warps >= 1
    assert adamw_config(75, torch.float32) == adamw_module.DEFAULT_CONFIG


def test_full_blocks_compile_to_16_byte_accesses():
    # compiled for sm90 in a process without the interpreter (no GPU needed): the full-block branch
    # must load and store in 16-byte vectors, which the alignment hints on the loaded pointers give
    script = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from fastlm.optim.adamw import _adamw_kernel
scalars = ["decay", "avg_weight", "beta2", "sq_weight", "step_size", "bias_correction2_sqrt", "eps"]
constexprs = {"BLOCK": 4096, "LOW_DTYPE": None}  # fp32 parameters
signature = {"TENSORS": "*i64", "BLOCKS": "*i64", **dict.fromkeys(scalars, "fp32"),
             **dict.fromkeys(constexprs, "constexpr")}
source = ASTSource(_adamw_kernel, signature=signature, constexprs=constexprs)
ptx = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 8}).asm["ptx"]
print(ptx.count("ld.global.v4.b32"), ptx.count("st.global.v4.b32"))
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    src = str(Path(adamw_module.__file__).parents[2])
    env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [env.get("PYTHONPATH")])])
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True)
    loads, stores = map(int, out.stdout.split())
    # 4096 elements over 256 threads: 16 per thread and tensor, four 16-byte vectors of each of
    # the 4 tensors read and the 3 written
    assert (loads, stores) == (16, 12)


@pytest.mark.gpu
def test_gpu_matches_torch_adamw():
    # a few million elements: many full blocks, a partial one at the end of most tensors
    shapes = [(1,), (4097,), (1600, 1601), (3, 1000, 333), (1 << 20,)]
    ours = make_params(shapes, "cuda")
    theirs = clone_params(ours)
    ours_opt = AdamW(two_groups(ours, lr=3e-3), lr=1e-2, weight_decay=0.1)
    theirs_opt = torch.optim.AdamW(two_groups(theirs, lr=3e-3), lr=1e-2, weight_decay=0.1, foreach=False)
    step_both(ours_opt, theirs_opt, ours, theirs, steps=5)
    assert_same_state(ours_opt, theirs_opt, ours, theirs)


@pytest.mark.gpu
def test_gpu_step_does_not_synchronize():
    ours = make_params([(1000,), (64, 65)], "cuda")
    opt = AdamW(ours)
    for p in ours:
        p.grad = torch.randn_like(p)
    opt.step()  # states created
    torch.cuda.set_sync_debug_mode("error")  # any synchronizing call raises
    try:
        opt.step()  # tables cached
        for p in ours:
            p.grad = torch.randn_like(p)
        opt.step()  # tables rebuilt: the host-to-device copy must not synchronize either
    finally:
        torch.cuda.set_sync_debug_mode("default")


def low_precision_step_both(ours_opt, theirs_opt, ours, theirs, steps: int, dtype) -> None:
    """``steps`` steps: our parameters are stored in ``dtype`` and get gradients in it, torch's are
    fp32 masters with the same gradients upcast (what autocast's fp32 weights receive)."""
    for _ in range(steps):
        for p, q in zip(ours, theirs, strict=True):
            p.grad = torch.randn_like(p)  # in the stored dtype
            q.grad = p.grad.float()
        ours_opt.step()
        theirs_opt.step()


def assert_masters_match(ours_opt, theirs_opt, ours, theirs, dtype) -> None:
    for p, q in zip(ours, theirs, strict=True):
        state = ours_opt.state[p]
        assert p.dtype == dtype and state["master"].dtype == torch.float32
        torch.testing.assert_close(state["master"], q, rtol=TOLERANCES["param"][0], atol=TOLERANCES["param"][1])
        assert torch.equal(p, state["master"].to(dtype))  # the stored parameter is its master rounded
        for key in ("exp_avg", "exp_avg_sq", "step"):
            torch.testing.assert_close(
                state[key], theirs_opt.state[q][key], rtol=TOLERANCES[key][0], atol=TOLERANCES[key][1]
            )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("config", [SMALL_BLOCKS, None], ids=["16-element blocks", "default blocks"])
def test_low_precision_params_keep_fp32_masters(dtype, config, device):
    ours = make_params(SHAPES, device)
    theirs = clone_params(ours)
    ours_opt = AdamW(two_groups(ours, param_dtype=dtype), lr=1e-2, weight_decay=0.1, config=config)
    theirs_opt = torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.1, foreach=False)
    half = len(ours) // 2
    assert [p.dtype for p in ours] == [torch.float32] * half + [dtype] * (len(ours) - half)
    for p, q in zip(ours[:half], theirs[:half], strict=True):  # the fp32 group gets its gradients as ever
        p.grad = q.grad = None
    low_precision_step_both(ours_opt, theirs_opt, ours[half:], theirs[half:], steps=3, dtype=dtype)
    assert_masters_match(ours_opt, theirs_opt, ours[half:], theirs[half:], dtype)


def test_low_precision_params_through_torchs_path(monkeypatch):
    """Where the kernel does not run (CPU without the interpreter), torch's functional updates the
    masters and the parameters are rounded from them: the same results."""
    monkeypatch.setattr(adamw_module, "runs_triton", lambda tensor: False)
    ours = make_params(SHAPES, "cpu")
    theirs = clone_params(ours)
    ours_opt = AdamW([{"params": ours, "param_dtype": torch.bfloat16}], lr=1e-2)
    theirs_opt = torch.optim.AdamW(theirs, lr=1e-2, foreach=False)
    low_precision_step_both(ours_opt, theirs_opt, ours, theirs, steps=2, dtype=torch.bfloat16)
    assert_masters_match(ours_opt, theirs_opt, ours, theirs, torch.bfloat16)


def test_low_precision_state_dict_keeps_fp32_masters(device):
    ours = make_params(SHAPES, device)
    theirs = clone_params(ours)
    ours_opt = AdamW([{"params": ours, "param_dtype": torch.bfloat16}], lr=1e-2, config=SMALL_BLOCKS)
    theirs_opt = torch.optim.AdamW(theirs, lr=1e-2, foreach=False)
    low_precision_step_both(ours_opt, theirs_opt, ours, theirs, steps=2, dtype=torch.bfloat16)
    saved = copy.deepcopy(ours_opt.state_dict())
    # a new run: fresh fp32 parameters made bf16 by a new optimizer, which then loads the state
    resumed = [torch.nn.Parameter(p.detach().float()) for p in ours]
    resumed_opt = AdamW([{"params": resumed, "param_dtype": torch.bfloat16}], lr=1e-2, config=SMALL_BLOCKS)
    resumed_opt.load_state_dict(saved)
    for p, q in zip(resumed, ours, strict=True):
        assert resumed_opt.state[p]["master"].dtype == torch.float32
        assert torch.equal(resumed_opt.state[p]["master"], ours_opt.state[q]["master"])
        assert torch.equal(resumed_opt.state[p]["exp_avg_sq"], ours_opt.state[q]["exp_avg_sq"])
    low_precision_step_both(resumed_opt, theirs_opt, resumed, theirs, steps=1, dtype=torch.bfloat16)
    assert_masters_match(resumed_opt, theirs_opt, resumed, theirs, torch.bfloat16)


def test_low_precision_groups_refuse_bad_dtypes():
    with pytest.raises(ValueError, match="param_dtype must be None, torch.bfloat16 or torch.float16"):
        AdamW([{"params": make_params([(4,)], "cpu"), "param_dtype": torch.int8}])
    with pytest.raises(ValueError, match="param_dtype torch.bfloat16 needs fp32 parameters"):
        AdamW([{"params": make_params([(4,)], "cpu", torch.float16), "param_dtype": torch.bfloat16}])


def test_parameters_already_low_get_masters_upcast_from_them(device):
    """A bf16 parameter (a bf16 checkpoint) in a bf16 group stays as it is; its master starts as
    its fp32 value, and it then trains as an fp32 parameter of that value would."""
    ours = make_params([(3, 5), (17,)], device, torch.bfloat16)
    theirs = [torch.nn.Parameter(p.detach().float()) for p in ours]
    storage = [p.data_ptr() for p in ours]
    ours_opt = AdamW([{"params": ours, "param_dtype": torch.bfloat16}], lr=1e-2, config=SMALL_BLOCKS)
    theirs_opt = torch.optim.AdamW(theirs, lr=1e-2, foreach=False)
    assert [p.data_ptr() for p in ours] == storage and {p.dtype for p in ours} == {torch.bfloat16}
    low_precision_step_both(ours_opt, theirs_opt, ours, theirs, steps=2, dtype=torch.bfloat16)
    assert_masters_match(ours_opt, theirs_opt, ours, theirs, torch.bfloat16)


@pytest.mark.gpu
def test_gpu_low_precision_params_keep_fp32_masters():
    shapes = [(1,), (4097,), (1600, 1601), (1 << 20,)]
    ours = make_params(shapes, "cuda")
    theirs = clone_params(ours)
    ours_opt = AdamW([{"params": ours, "param_dtype": torch.bfloat16}], lr=1e-2, weight_decay=0.1)
    theirs_opt = torch.optim.AdamW(theirs, lr=1e-2, weight_decay=0.1, foreach=False)
    low_precision_step_both(ours_opt, theirs_opt, ours, theirs, steps=3, dtype=torch.bfloat16)
    assert_masters_match(ours_opt, theirs_opt, ours, theirs, torch.bfloat16)


def test_bf16_matmul_weights_train_as_autocast_does():
    """A model whose matmul weights AdamW stores in bf16 (fp32 masters) trains, under bf16 autocast,
    to the same losses as the same model with fp32 weights and torch's AdamW: autocast rounds fp32
    weights to the same bf16 values, and the weight gradients are the same bf16 products."""
    from fastlm.layers.linear import linear_weights
    from fastlm.model import ModelConfig, TransformerLM

    torch.manual_seed(0)
    config = ModelConfig.preset("tiny")
    ours, theirs = TransformerLM(config), TransformerLM(config)
    theirs.load_state_dict(ours.state_dict())
    low = linear_weights(ours.blocks)
    low_ids = {id(p) for p in low}
    rest = [p for p in ours.parameters() if id(p) not in low_ids]
    ours_opt = AdamW([{"params": low, "param_dtype": torch.bfloat16}, {"params": rest}], lr=1e-3)
    theirs_opt = torch.optim.AdamW(theirs.parameters(), lr=1e-3, foreach=False)
    assert {p.dtype for p in low} == {torch.bfloat16} and {p.dtype for p in rest} == {torch.float32}
    tokens = torch.randint(0, config.vocab_size, (2, 33))
    for _ in range(3):
        losses = []
        for model, opt in ((ours, ours_opt), (theirs, theirs_opt)):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        assert losses[0] == losses[1]
