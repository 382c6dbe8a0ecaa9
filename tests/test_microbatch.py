"""Micro-batches of any pytree: every tensor leaf split along dim 0, the rest shared; outputs joined back; clear errors."""

from __future__ import annotations

import pytest
import torch

from pipecomm.runtime import microbatch


def test_every_tensor_leaf_is_split_and_other_leaves_are_shared():
    tokens, mask, bias = torch.arange(8).reshape(4, 2), torch.ones(4, 3, dtype=torch.bool), torch.randn(4, 5)
    batch = ((tokens,), {"attention_mask": mask, "extra": {"bias": bias, "scale": 2.0, "name": "x", "none": None}})
    chunks = microbatch.split(batch, 2, "inputs")
    assert len(chunks) == 2
    for index, ((chunk_tokens,), kwargs) in enumerate(chunks):
        torch.testing.assert_close(chunk_tokens, tokens.chunk(2)[index])
        torch.testing.assert_close(kwargs["attention_mask"], mask.chunk(2)[index])
        torch.testing.assert_close(kwargs["extra"]["bias"], bias.chunk(2)[index])
        assert (kwargs["extra"]["scale"], kwargs["extra"]["name"], kwargs["extra"]["none"]) == (2.0, "x", None)


def test_training_batches_must_divide_evenly_and_errors_name_the_leaf():
    with pytest.raises(ValueError, match=r"inputs\[0\] has batch size 7, which is not divisible by micro_batches=4"):
        microbatch.split((torch.ones(7), torch.ones(7)), 4, "inputs")
    with pytest.raises(ValueError, match=r"inputs\[1\] has batch size 4 but inputs\[0\] has 8; every tensor"):
        microbatch.split((torch.ones(8), torch.ones(4)), 4, "inputs")
    with pytest.raises(ValueError, match=r"^kwargs\['mask'\] has batch size 4 but inputs\[0\] has 8"):
        microbatch.split(microbatch.Batch((torch.ones(8),), {"mask": torch.ones(4)}), 4, "")
    with pytest.raises(ValueError, match=r"kwargs\['attention_mask'\] has batch size 3"):
        microbatch.split({"attention_mask": torch.ones(3)}, 2, "kwargs")
    with pytest.raises(ValueError, match=r"target\[0\]\['y'\] is a 0-d tensor"):
        microbatch.split(({"y": torch.tensor(1.0)},), 2, "target")


@pytest.mark.parametrize(("batch", "sizes"), [(1, [1]), (3, [1, 1, 1]), (5, [2, 1, 1, 1]), (8, [2, 2, 2, 2])])
def test_inference_splits_any_batch_into_at_most_micro_batches_chunks(batch, sizes):
    chunks = microbatch.split(({"x": torch.arange(batch)}, 7), 4, "inputs", uneven=True)
    assert [len(chunk[0]["x"]) for chunk in chunks] == sizes
    assert all(chunk[1] == 7 for chunk in chunks)
    torch.testing.assert_close(torch.cat([chunk[0]["x"] for chunk in chunks]), torch.arange(batch))
    with pytest.raises(ValueError, match="the batch is empty"):
        microbatch.split((torch.ones(0),), 4, "inputs", uneven=True)


def test_join_concatenates_tensors_stacks_0d_ones_and_keeps_equal_constants():
    outputs = [{"logits": torch.full((2, 3), float(index)), "loss": torch.tensor(float(index)), "vocab": 3,
                "cache": (None,)} for index in range(3)]
    joined = microbatch.join(outputs)
    torch.testing.assert_close(joined["logits"], torch.cat([output["logits"] for output in outputs]))
    torch.testing.assert_close(joined["loss"], torch.tensor([0.0, 1.0, 2.0]))
    assert joined["vocab"] == 3 and joined["cache"] == (None,)
    single = microbatch.join([torch.ones(1, 2), torch.zeros(2, 2)])
    assert isinstance(single, torch.Tensor) and single.shape == (3, 2)


def test_join_takes_a_tensor_that_is_no_batch_once_and_refuses_one_that_differs():
    # A model's own statistic (a codebook's norms, shape (3,)) came back concatenated: (9,) for three micro-batches,
    # where model(x) returns (3,), silently.
    norms = torch.arange(3.0)
    outputs = [{"logits": torch.full((size, 2), float(size)), "norms": norms.clone()} for size in (3, 3, 2)]
    joined = microbatch.join(outputs, batch_size=8)
    assert joined["logits"].shape == (8, 2) and torch.equal(joined["norms"], norms)
    outputs[2]["norms"] = norms + 1
    with pytest.raises(ValueError, match=r"output tensor 1 has sizes \[3, 3, 3\] along dim 0 in the micro-batches of "
                                         r"sizes \[3, 3, 2\], and differs between them"):
        microbatch.join(outputs, batch_size=8)


def test_join_refuses_outputs_that_differ_in_constants_or_structure():
    with pytest.raises(ValueError, match="micro-batch 1 does not match micro-batch 0's.*leaf 1 is 5"):
        microbatch.join([(torch.ones(1), 4), (torch.ones(1), 5)])
    with pytest.raises(ValueError, match="micro-batch 1 does not match micro-batch 0's.*structure"):
        microbatch.join([(torch.ones(1),), [torch.ones(1)]])


def test_any_requires_grad_looks_at_every_tensor_of_plain_and_nested_batches():
    plain, grad = torch.randn(4, 2), torch.randn(4, 2, requires_grad=True)
    assert not microbatch.any_requires_grad(microbatch.Batch((plain,), {"mask": plain}))
    assert microbatch.any_requires_grad(microbatch.Batch((plain,), {"mask": grad}))
    assert microbatch.any_requires_grad((plain, grad))  # targets
    assert not microbatch.any_requires_grad((plain, 3))
    assert microbatch.any_requires_grad(microbatch.Batch(({"x": [plain, grad]},), {}))  # nested: through pytree
    assert not microbatch.any_requires_grad(microbatch.Batch(({"x": [plain, None]}, "text"), {}))


def test_a_matrix_over_each_micro_batchs_samples_is_refused_where_their_sizes_differ():
    # A contrastive model's logits, (micro-batch, micro-batch): torch.cat failed with its own message.
    outputs = [torch.zeros(2, 2), torch.zeros(2, 2), torch.zeros(1, 1), torch.zeros(1, 1)]
    with pytest.raises(ValueError, match=r"output tensor 0 has shapes \[\(2, 2\), \(2, 2\), \(1, 1\), \(1, 1\)\] in the "
                                         r"micro-batches of sizes \[2, 2, 1, 1\]: more than its batch dimension"):
        microbatch.join(outputs, batch_size=6)
