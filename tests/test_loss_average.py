"""The step's loss is the mean of the micro-batches' losses: where a torch loss shows that this differs from one
process's loss on the whole batch (a sum, cross-entropy over padded or weighted targets), the last stage warns once;
with the batch's count passed as a target, the step equals one process."""

from __future__ import annotations

import copy
import functools
import warnings

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import pipecomm
from pipecomm.runtime.loss_average import uneven_average

TOLERANCE = dict(rtol=1e-5, atol=1e-6)


def _labels(padded_rows: int = 0) -> torch.Tensor:
    """8 rows of 6 class indices; the last ``padded_rows`` ignore their last 4 positions."""
    labels = torch.arange(48).reshape(8, 6) % 5
    if padded_rows:
        labels[8 - padded_rows:, 2:] = -100
    return labels


def _split(targets: torch.Tensor, micro_batches: int = 4) -> list[tuple]:
    return [(part,) for part in targets.chunk(micro_batches)]


@pytest.mark.parametrize("loss_fn", [F.cross_entropy, F.nll_loss, nn.CrossEntropyLoss(), nn.NLLLoss(),
                                     functools.partial(F.cross_entropy, label_smoothing=0.1)],
                         ids=["F.cross_entropy", "F.nll_loss", "CrossEntropyLoss", "NLLLoss", "partial"])
def test_padded_targets_that_differ_between_micro_batches_are_named(loss_fn):
    reason = uneven_average(loss_fn, _split(_labels(padded_rows=2)))
    assert reason is not None and "come to 12, 12, 12, 4" in reason, reason
    assert uneven_average(loss_fn, _split(_labels())) is None  # the same count everywhere
    assert uneven_average(loss_fn, _split(_labels(padded_rows=2), micro_batches=1)) is None


def test_the_loss_settings_decide_what_is_counted():
    labels = torch.ones(8, 6, dtype=torch.long)
    labels[2, 0] = 0  # in the second micro-batch, one target of class 0, which weighs 3
    assert uneven_average(nn.CrossEntropyLoss(), _split(labels)) is None
    reason = uneven_average(nn.CrossEntropyLoss(weight=torch.tensor([3.0, 1, 1, 1, 1])), _split(labels))
    assert reason is not None and "class weights" in reason and "12, 14, 12, 12" in reason, reason
    # ignore_index as given: nothing is ignored when it is another value than the padding's
    assert uneven_average(functools.partial(F.cross_entropy, ignore_index=7), _split(_labels(padded_rows=2))) is None
    for summing in (nn.CrossEntropyLoss(reduction="sum"), nn.MSELoss(reduction="sum"),
                    functools.partial(F.cross_entropy, reduction="sum")):
        assert "1/4 of one process's" in uneven_average(summing, _split(labels))
        assert uneven_average(summing, _split(labels, micro_batches=1)) is None  # one micro-batch: the whole batch


@pytest.mark.parametrize("loss_fn", [lambda output, target: F.cross_entropy(output, target), F.mse_loss,
                                     functools.partial(F.cross_entropy, torch.zeros(2, 5))],
                         ids=["a lambda", "F.mse_loss", "partial with a positional"])
def test_a_loss_of_the_callers_own_given_padded_labels_alone_is_named_conditionally(loss_fn):
    reason = uneven_average(loss_fn, _split(_labels(padded_rows=2)))
    assert reason is not None and "if loss_fn averages over the targets it does not ignore" in reason, reason
    assert "come to 12, 12, 12, 4" in reason, reason
    assert uneven_average(loss_fn, _split(_labels())) is None  # no padding
    # beside the labels, the batch's count (docs/using.md's recipe): loss_fn may weigh them itself
    assert uneven_average(loss_fn, [(labels, 40) for (labels,) in _split(_labels(padded_rows=2))]) is None


def test_a_mean_over_elements_passes_quietly():
    assert uneven_average(nn.MSELoss(), _split(_labels(padded_rows=2))) is None


def test_class_probabilities_count_every_position():
    probabilities = torch.rand(8, 5).softmax(-1)
    assert uneven_average(F.cross_entropy, _split(probabilities)) is None


class _ClassesFirst(nn.Module):
    """(batch, positions, classes) -> (batch, classes, positions), as cross-entropy takes a sequence's logits."""

    def forward(self, logits):
        return logits.transpose(1, 2)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Embedding(5, 8), nn.Linear(8, 5), _ClassesFirst())


def _pipeline(model: nn.Module, loss_fn) -> pipecomm.Pipeline:
    return pipecomm.Pipeline(model, stage=0, num_stages=1, micro_batches=4, loss_fn=loss_fn)


def test_a_padded_batch_warns_once_and_the_count_as_a_target_is_exact():
    model = _model()
    reference = copy.deepcopy(model)
    x, labels = torch.arange(48).reshape(8, 6) % 5, _labels(padded_rows=2)
    plain = _pipeline(copy.deepcopy(model), F.cross_entropy)
    with pytest.warns(UserWarning, match=r"rank 0: loss_fn \(torch.nn.functional.cross_entropy\)") as caught:
        for _ in range(3):
            plain.step(x, target=labels)
    assert len(caught) == 1 and "The loss of a step" in str(caught[0].message)
    assert caught[0].filename == __file__  # the caller's step, not pipecomm's insides

    def token_mean(logits, target, tokens):
        return F.cross_entropy(logits, target, reduction="sum") * 4 / tokens

    exact = _pipeline(model, token_mean)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loss = exact.step(x, target=(labels, int((labels != -100).sum())))
    expected = F.cross_entropy(reference(x), labels)
    expected.backward()
    torch.testing.assert_close(loss, expected.detach(), **TOLERANCE)
    for param, ref in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(param.grad, ref.grad, **TOLERANCE)
