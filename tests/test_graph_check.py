"""graph_check: a checked capture's replays against eager, relative to the eager tensor's largest entry, with NaN and a
missing gradient caught; accumulators checked to be about zero."""

from __future__ import annotations

import torch

from pipecomm.runtime.graph_check import largest_difference, off_zero, signed


def test_replays_equal_to_eager_within_the_dtypes_tolerance_pass():
    eager = [torch.tensor([4.0, -2.0]), torch.tensor([1.0, 1.0], dtype=torch.bfloat16)]
    replayed = [eager[0] + 1e-3 * 4 * 0.9, eager[1] + 0.01]  # fp32: 1e-3 of 4; bf16: 2e-2 of 1
    assert largest_difference([("output", replayed, eager)]) is None


def test_the_first_replayed_tensor_off_eager_is_named():
    eager = [torch.tensor([4.0, -2.0]), torch.tensor([1.0, 3.0])]
    replayed = [eager[0].clone(), torch.tensor([1.0, 3.1])]
    found = largest_difference([("output", [eager[0].clone()], [eager[0]]), ("input gradient", replayed, eager)])
    assert found is not None and found.startswith("input gradient 1: largest difference 0.1")


def test_nan_and_a_gradient_missing_on_one_side_are_caught():
    eager = [torch.tensor([1.0, 2.0])]
    assert "output 0" in largest_difference([("output", [torch.tensor([1.0, float("nan")])], eager)])
    assert largest_difference([("parameter gradient", [None], eager)]) == \
        "parameter gradient 0 is missing in the replay only"
    assert largest_difference([("parameter gradient", eager, [None])]) == \
        "parameter gradient 0 is present in the replay only"


def test_accumulators_about_zero_relative_to_eager_pass_and_others_are_named():
    largest = [torch.tensor(10.0), torch.tensor(10.0)]
    assert off_zero([torch.full((3,), 5e-3), torch.zeros(2)], largest) is None
    found = off_zero([torch.zeros(3), torch.tensor([0.0, 0.5])], largest)
    assert found is not None and found.startswith("parameter gradient 1: largest difference 0.5")
    assert off_zero([torch.tensor([float("nan")])], largest[:1]) is not None


def test_signed_gives_a_negated_probe_s_gradients_back_their_sign():
    grads = [torch.tensor([1.0, -2.0]), None]
    assert torch.equal(signed(grads, -1.0)[0], torch.tensor([-1.0, 2.0])) and signed(grads, -1.0)[1] is None
    assert signed(grads, 1.0)[0] is grads[0]
