"""``layers.FusedWeights``: parameters become views of one tensor, loads copy into it, and a
parameter made under inference mode (a test building the model inside
``torch.inference_mode()``) still works after fusion (session 26's side-stream GPU test
failed on it: "Inference tensors do not track version counter")."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from rackserve.model.layers import FusedWeights


def _fusion(linears: list[nn.Linear]) -> FusedWeights:
    sizes = [lin.out_features for lin in linears]
    return FusedWeights(
        [(lin, "weight") for lin in linears], torch.cat, lambda f: list(f.split(sizes))
    )


@pytest.mark.parametrize("made_in_inference_mode", [False, True])
def test_parameters_become_views_of_the_fused_weight(made_in_inference_mode):
    torch.manual_seed(0)
    with torch.inference_mode(made_in_inference_mode):
        a, b = nn.Linear(8, 4, bias=False), nn.Linear(8, 3, bias=False)
    expected = torch.cat([a.weight.detach().clone(), b.weight.detach().clone()])
    fused = _fusion([a, b])
    with torch.inference_mode():
        w = fused.get()
        assert torch.equal(w, expected)
        assert a.weight.data_ptr() == w.data_ptr()
        assert b.weight.data_ptr() == w[4:].data_ptr()
        x = torch.randn(5, 8)
        assert torch.equal(F.linear(x, a.weight), F.linear(x, w[:4]))  # the failing op
        assert torch.equal(b(x), F.linear(x, w[4:]))
    assert fused.intact() and fused.get() is w
    # a load copies into the fused tensor
    b.load_state_dict({"weight": torch.ones(3, 8)})
    assert torch.equal(w[4:], torch.ones(3, 8)) and fused.get() is w
    # replacing a parameter's data breaks the fusion: the next get rebuilds it
    a.weight.data = torch.zeros(4, 8)
    assert not fused.intact()
    rebuilt = fused.get()
    assert rebuilt is not w and torch.equal(rebuilt[:4], torch.zeros(4, 8))
    assert a.weight.data_ptr() == rebuilt.data_ptr()
