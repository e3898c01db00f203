import pytest
import torch
from torch import nn

from fastlm.model import ModelConfig, TransformerLM
from fastlm.model.materialize import materialize


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_meta_model_materializes_to_the_constructors_values(device):
    config = ModelConfig.preset("tiny", num_layers=2)
    torch.manual_seed(3)
    with torch.device(device):  # drawn by that device's generator, as materialize draws them
        built = TransformerLM(config)
    with torch.device("meta"):
        model = TransformerLM(config)
    torch.manual_seed(3)
    materialize(model, torch.device(device))
    expected = built.state_dict()
    for name, value in model.state_dict().items():
        assert torch.equal(value, expected[name]), name
    rope = model.blocks[0].attention.rope  # buffers, not in the state dict
    assert torch.equal(rope.cos, built.blocks[0].attention.rope.cos)


def test_a_module_without_reset_parameters_is_refused():
    with torch.device("meta"):
        model = nn.Sequential(nn.Module())
        model[0].weight = nn.Parameter(torch.empty(3))
    with pytest.raises(TypeError, match=r"0 \(Module\) holds tensors but has no reset_parameters"):
        materialize(model, torch.device("cpu"))
