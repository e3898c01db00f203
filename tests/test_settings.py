"""The vocabularies of fastlm.settings: one Kernels for every user, importable without torch."""

import subprocess
import sys

import pytest

from fastlm.settings import SWITCHES, Kernels, runs_fused


def test_kernel_sets_and_single_switches():
    assert Kernels() == Kernels.named("torch")
    fastlm = Kernels.named("fastlm")
    assert fastlm.as_dict() == {
        "attention": "fastlm",
        "norm": "auto",
        "rope": "auto",
        "mlp": "auto",
        "loss": "fastlm",
        "softmax": "fastlm",
    }
    assert fastlm.replace(norm="fastlm", mlp=None) == Kernels(**{**fastlm.as_dict(), "norm": "fastlm"})
    assert tuple(fastlm.as_dict()) == SWITCHES
    with pytest.raises(ValueError, match="kernels must be one of torch, fastlm, got 'liger'"):
        Kernels.named("liger")
    with pytest.raises(ValueError, match="rope must be one of torch, fastlm, auto, got 'cuda'"):
        Kernels(rope="cuda")


@pytest.mark.parametrize(
    ("switch", "eager", "compiling"), [("torch", False, False), ("fastlm", True, True), ("auto", True, False)]
)
def test_the_one_rule_of_fused_switches(switch, eager, compiling):
    assert runs_fused(switch, compiling=False) is eager
    assert runs_fused(switch, compiling=True) is compiling


def test_settings_import_no_torch():
    code = "import sys, fastlm.settings; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)
