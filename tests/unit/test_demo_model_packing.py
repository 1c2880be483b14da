"""The demo model's training batches: a job packed as a tree, and the context loss."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from warmloop.infra.demo_model.model import (  # noqa: E402
    PACKED_FIELDS,
    DemoLlama,
    FlatJobs,
    ModelConfig,
    batch_tensors,
    pack_job,
    packed_loss,
)

TRUNK = [5, 6, 7, 8, 9]
BRANCHES = [(2, [10], [11, 12]), (5, [10], [13])]


def test_without_context_targets_only_call_tokens_are_targets() -> None:
    job = pack_job(TRUNK, BRANCHES)
    assert job.context is None
    assert job.targets[:len(TRUNK)] == [-1] * len(TRUNK)
    # a branch's tail predicts the call's first token, each call token the next
    assert [t for t in job.targets if t >= 0] == [11, 12, 13]


def test_context_targets_predict_the_next_trunk_token_and_nothing_in_branches() -> None:
    job = pack_job(TRUNK, BRANCHES, context_targets=True)
    assert job.context is not None
    assert job.targets[:len(TRUNK)] == [6, 7, 8, 9, -1]
    assert job.context[:len(TRUNK)] == [True, True, True, True, False]
    assert not any(job.context[len(TRUNK):])
    assert job.weights[:len(TRUNK)] == [0.0] * len(TRUNK)
    # the call targets are the same with or without the context ones
    plain = pack_job(TRUNK, BRANCHES)
    assert job.targets[len(TRUNK):] == plain.targets[len(TRUNK):]
    assert job.weights == plain.weights


def _loss(job_ctx: bool, weight: float) -> tuple[float, dict[str, float]]:
    torch.manual_seed(0)
    model = DemoLlama(ModelConfig(vocab_size=16, hidden_size=16, intermediate_size=32,
                                  num_hidden_layers=1, num_attention_heads=2))
    job = pack_job(TRUNK, BRANCHES, context_targets=job_ctx)
    bt = batch_tensors([job], 1, pad_id=0)
    with torch.no_grad():
        loss, stats = packed_loss(model, torch.tensor([1]), torch.tensor([0]), bt, weight)
    return float(loss), stats


def test_context_loss_adds_its_weighted_mean_and_leaves_the_call_loss_alone() -> None:
    call_only, stats0 = _loss(False, 0.0)
    same_targets_no_weight, stats1 = _loss(True, 0.0)
    with_context, stats2 = _loss(True, 0.5)
    # context targets never leak into the call loss or its accuracy
    assert same_targets_no_weight == pytest.approx(call_only)
    assert stats1["tokens"] == stats0["tokens"] == 3
    assert "context_loss" not in stats1
    assert with_context == pytest.approx(call_only + 0.5 * stats2["context_loss"], rel=1e-5)
    assert stats2["context_loss"] > 0


def test_flat_jobs_gather_the_same_batch_as_batch_tensors() -> None:
    """Gathering rows out of order from a store of many jobs (the GPU bench) gives the
    batch those jobs make alone (the CPU trainer's ``batch_tensors``), padding
    included."""
    jobs = [pack_job(TRUNK, BRANCHES), pack_job([3, 4], [(1, [10], [11])]),
            pack_job(TRUNK + [1, 2], BRANCHES + [(7, [10, 10], [12, 13, 14])])]
    fields = {f: [x for j in jobs for x in getattr(j, f)] for f in PACKED_FIELDS}
    flat = FlatJobs(fields, [len(j.ids) for j in jobs], torch.device("cpu"))
    rows = [2, 0, 1]
    want = batch_tensors([jobs[r] for r in rows], 3, pad_id=0, position_offset=4)
    got = flat.batch(rows, 3, pad_id=0, position_offset=4)
    assert set(got) == set(want)
    for k in want:
        assert torch.equal(got[k], want[k]), k


@pytest.mark.parametrize("gather", ["host", "device"])
def test_a_packed_step_computes_what_its_real_prompt_does(gather: str) -> None:
    """The tree packing's promise: each branch token's logits equal those of the same
    token in the step's real prompt (prefix, the trunk up to the branch point, tail,
    call) run plainly causal; padding and the other branches change nothing. Both batch
    builders (the host's ``batch_tensors``, the device's ``FlatJobs``) keep it."""
    torch.manual_seed(0)
    model = DemoLlama(ModelConfig(vocab_size=16, hidden_size=16, intermediate_size=32,
                                  num_hidden_layers=2, num_attention_heads=2))
    prefix = [1, 2, 3]
    short = pack_job([3, 4], [(1, [10], [11])])
    job = pack_job(TRUNK, BRANCHES)
    if gather == "host":
        bt = batch_tensors([job, short], len(prefix), pad_id=0)
    else:
        fields = {f: [x for j in (job, short) for x in getattr(j, f)] for f in PACKED_FIELDS}
        bt = FlatJobs(fields, [len(job.ids), len(short.ids)], torch.device("cpu")).batch(
            [0, 1], len(prefix), pad_id=0)
    with torch.no_grad():
        _, past = model.hidden(torch.tensor([prefix]), torch.arange(3).unsqueeze(0), None)
        h, _ = model.hidden(bt["ids"], bt["positions"], bt["mask"], past)
        packed = model.logits(h[0])
        at_index = len(TRUNK)
        for at, tail, target in BRANCHES:
            seq = prefix + TRUNK[:at] + tail + target
            plain = model.logits(model.hidden(torch.tensor([seq]),
                                              torch.arange(len(seq)).unsqueeze(0), None)[0])[0]
            n = len(tail) + len(target)
            torch.testing.assert_close(packed[at_index:at_index + n], plain[-n:],
                                       rtol=1e-4, atol=1e-5)
            at_index += n
        # the trunk itself reads as the plain prompt without any branch
        seq = prefix + TRUNK
        plain = model.logits(model.hidden(torch.tensor([seq]),
                                          torch.arange(len(seq)).unsqueeze(0), None)[0])[0]
        torch.testing.assert_close(packed[:len(TRUNK)], plain[len(prefix):],
                                   rtol=1e-4, atol=1e-5)
