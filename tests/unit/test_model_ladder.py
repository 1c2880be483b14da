"""The model ladder's decisions (issue 20): when a step goes one model up, and why."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from warmloop.workflows.ladder import (
    CallConfidence,
    EscalationReason,
    HardCall,
    ModelLadder,
    escalation,
    start_level,
)

LADDER = ModelLadder(models=("small", "large"), min_mean_logprob=-0.3,
                     min_token_logprob=-4.0,
                     hard_calls=(HardCall(tool="approve_payment", field="amount", over=10_000),
                                 HardCall(tool="draft_reply")))
SURE = CallConfidence(mean=-0.05, minimum=-0.9, tokens=20)


def test_a_sure_valid_easy_call_stays_on_the_cheap_model() -> None:
    assert escalation(LADDER, 0, invalid=None, tool="lookup_customer", args={"id": "C1"},
                      confidence=SURE) is None


def test_an_invalid_call_escalates_with_its_error() -> None:
    e = escalation(LADDER, 0, invalid="unknown tool 'x'", tool=None, args=None,
                   confidence=SURE)
    assert e is not None and e.reason == EscalationReason.INVALID and "unknown" in e.detail
    off = LADDER.model_copy(update={"escalate_invalid": False})
    assert escalation(off, 0, invalid="bad", tool=None, args=None, confidence=SURE) is None


@pytest.mark.parametrize(("mean", "minimum"), [(-0.5, -0.9), (-0.1, -6.0)])
def test_an_unsure_call_escalates(mean: float, minimum: float) -> None:
    e = escalation(LADDER, 0, invalid=None, tool="lookup_customer", args={},
                   confidence=CallConfidence(mean=mean, minimum=minimum, tokens=10))
    assert e is not None and e.reason == EscalationReason.LOW_CONFIDENCE


def test_hard_calls_go_to_the_top_model_by_tool_and_by_amount() -> None:
    small = escalation(LADDER, 0, invalid=None, tool="approve_payment",
                       args={"amount": 9_000}, confidence=SURE)
    big = escalation(LADDER, 0, invalid=None, tool="approve_payment",
                     args={"amount": 12_500}, confidence=SURE)
    reply = escalation(LADDER, 0, invalid=None, tool="draft_reply", args={}, confidence=SURE)
    assert small is None
    assert big is not None and big.reason == EscalationReason.HARD_AMOUNT
    assert "12500" in big.detail
    assert reply is not None and reply.reason == EscalationReason.HARD_TOOL
    # an amount given as a bool or text is not an amount
    assert escalation(LADDER, 0, invalid=None, tool="approve_payment",
                      args={"amount": True}, confidence=SURE) is None


def test_the_top_model_never_escalates() -> None:
    assert escalation(LADDER, 1, invalid="bad", tool=None, args=None,
                      confidence=CallConfidence(-9, -9, 1)) is None


def test_next_steps_go_back_down_unless_the_ladder_stays() -> None:
    assert start_level(LADDER, 1) == 0
    assert start_level(LADDER.model_copy(update={"stay_escalated": "job"}), 1) == 1


def test_confidence_of_no_tokens_is_unknown() -> None:
    assert CallConfidence.of([]) is None
    c = CallConfidence.of([-0.1, -0.3, -2.0])
    assert c is not None and c.minimum == -2.0 and c.tokens == 3
    assert c.mean == pytest.approx(-0.8)


@pytest.mark.parametrize("bad", [
    {"models": ("only",)},
    {"models": ("a", "a")},
    {"models": ("a", "b"), "min_mean_logprob": 0.5},
])
def test_a_ladder_that_cannot_work_is_refused(bad: dict[str, object]) -> None:
    with pytest.raises(ValidationError):
        ModelLadder.model_validate(bad)


def test_an_amount_rule_needs_both_field_and_threshold() -> None:
    with pytest.raises(ValidationError, match="field and over together"):
        HardCall(tool="pay", field="amount")


def test_the_deeper_sibling_starts_computing_what_the_small_model_does() -> None:
    torch = pytest.importorskip("torch")
    from warmloop.infra.demo_model.model import DemoLlama, ModelConfig, deepened

    torch.manual_seed(0)
    small = DemoLlama(ModelConfig(vocab_size=50, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4))
    big = deepened(small, 5)
    ids, pos = torch.randint(0, 50, (1, 9)), torch.arange(9)[None]
    assert len(big.model.layers) == 5
    assert torch.allclose(small.logits(small.hidden(ids, pos, None)[0]),
                          big.logits(big.hidden(ids, pos, None)[0]), atol=1e-5)
    with pytest.raises(ValueError, match="already has"):
        deepened(big, 3)


def test_the_wider_sibling_computes_what_the_small_model_does_until_noise_moves_it() -> None:
    torch = pytest.importorskip("torch")
    from warmloop.infra.demo_model.model import DemoLlama, ModelConfig, deepened, widened

    torch.manual_seed(0)
    small = DemoLlama(ModelConfig(vocab_size=50, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4))
    for blocks in small.model.layers:  # norms away from 1, so a wrong repeat shows
        blocks.input_layernorm.weight.data.uniform_(0.5, 1.5)
    small.model.norm.weight.data.uniform_(0.5, 1.5)
    ids, pos = torch.randint(0, 50, (1, 9)), torch.arange(9)[None]
    want = small.logits(small.hidden(ids, pos, None)[0])
    wide = widened(small, 2)
    assert (wide.cfg.hidden_size, wide.cfg.intermediate_size,
            wide.cfg.num_attention_heads, wide.cfg.head_dim) == (64, 128, 8, 8)
    assert torch.allclose(want, wide.logits(wide.hidden(ids, pos, None)[0]), atol=1e-4)
    both = deepened(widened(small, 3), 4)
    assert torch.allclose(want, both.logits(both.hidden(ids, pos, None)[0]), atol=1e-4)
    noisy = widened(small, 2, noise=0.05, generator=torch.Generator().manual_seed(1))
    moved = (noisy.logits(noisy.hidden(ids, pos, None)[0]) - want).abs().max()
    assert 0 < moved < 0.5 * want.abs().max()
    with pytest.raises(ValueError, match="at least 1"):
        widened(small, 0)


def test_embedded_engines_serve_a_pool_per_model(tmp_path: object) -> None:
    from pathlib import Path

    from warmloop.workers.settings import Settings

    big = Path(str(tmp_path)) / "large"
    s = Settings(engine_count=3, engine_models=["small", "small", "large"],
                 model_paths={"large": big})
    assert [e.model for e in s.engine_endpoints] == ["small", "small", "large"]
    assert s.engine_model_path(s.engine_endpoints[2]) == big
    assert s.engine_model_path(s.engine_endpoints[0]) == s.resolved_model_path
    with pytest.raises(ValidationError, match="one per engine"):
        Settings(engine_count=2, engine_models=["small"])


def test_the_report_shows_steps_per_model_escalations_and_cost_against_the_top() -> None:
    from warmloop.workers.report import report_table, summarize
    from warmloop.workflows.contracts import JobResult, JobState, StepRecord, Usage

    def step(n: int, model: str, cost: float, escalated: str | None = None) -> StepRecord:
        return StepRecord(step=n, kind="plan", engine_id="e0", route_reason="cache",
                          tool="t", valid=True, prompt_tokens=900, cached_tokens=800,
                          completion_tokens=100, ttft_ms=1.0, latency_ms=2.0,
                          cost_usd=cost, model=model, escalated=escalated)

    steps = [step(1, "small", 1.0), step(2, "small", 1.0, "low_confidence"),
             step(2, "large", 10.0), step(3, "small", 1.0)]
    r = JobResult(job_id="j", profile="p", state=JobState.FINISHED, reason="done",
                  steps=steps, usage=Usage(steps=3, cost_usd=13.0), transcript_key=None)
    s = summarize([r])
    assert s.steps_by_model == {"small": 3, "large": 1}
    assert s.escalations == {"low_confidence": 1}
    # every step's 1,000 tokens at the large model's rate (10.0 a step)
    assert s.top_only_cost_usd == pytest.approx(40.0)
    from rich.console import Console

    console = Console(record=True, width=200)
    console.print(report_table([r], title="t"))
    text = console.export_text()
    assert "steps by model" in text and "large 25%" in text and "0.33x" in text


def test_a_graded_report_prices_the_correct_outcomes_not_every_finished_job() -> None:
    from rich.console import Console

    from warmloop.workers.report import report_table
    from warmloop.workflows.contracts import JobResult, JobState, Usage

    results = [JobResult(job_id=f"j{i}", profile="p", state=JobState.FINISHED, reason="done",
                         steps=[], usage=Usage(steps=1, cost_usd=1.0), transcript_key=None)
               for i in range(4)]
    console = Console(record=True, width=200)
    console.print(report_table(results, title="t", correct={"p": (1, 4)}))
    text = console.export_text()
    # 4 finished jobs at $1: $1 per accepted outcome, but only one was right: $4 per correct
    assert "cost per accepted outcome" in text and "$1.000000" in text
    assert "cost per correct outcome" in text and "$4.000000" in text
    console = Console(record=True, width=200)
    console.print(report_table(results, title="t", correct={"p": (0, 4)}))
    assert [ln for ln in console.export_text().splitlines()
            if "cost per correct outcome" in ln][0].rstrip(" │").endswith(" -")
    console = Console(record=True, width=200)
    console.print(report_table(results, title="t"))
    assert "cost per correct outcome" not in console.export_text()


def test_a_yaml_profile_may_declare_a_ladder() -> None:
    from warmloop.workflows.profiles.document import ProfileDocument, profile_from_document

    doc = ProfileDocument.model_validate({
        "name": "yaml-laddered", "system_prompt": "Work.",
        "task_schema": {"type": "object", "properties": {"id": {"type": "string",
                                                                  "pattern": "^X[0-9]+$"}},
                        "required": ["id"]},
        "tools": [{"name": "finish", "description": "Done.", "finishes_job": True,
                   "arguments": {"type": "object", "properties": {}, "required": []}}],
        "ladder": {"models": ["a", "b"], "min_mean_logprob": -0.2,
                   "hard_calls": [{"tool": "finish"}]}})
    p = profile_from_document(doc)
    assert p.ladder is not None and p.ladder.models == ("a", "b")
    assert p.ladder.hard_calls[0].tool == "finish"


def test_the_ladder_bench_keeps_the_cheap_answer_only_when_it_stands(tmp_path: object) -> None:
    import json as _json
    from pathlib import Path

    from bench.ladder import (
        Answer,
        Engine,
        _finite,
        ladder_at,
        ladder_pick,
        non_embedding_params,
    )

    def answer(model: str, call: tuple[str, dict[str, object]] | None, mean: float) -> Answer:
        return Answer(model, call, None if call else "bad", CallConfidence(mean, mean, 5),
                      prompt_tokens=1000, cached_tokens=900, completion_tokens=20)

    large = answer("large", ("lookup", {"key": "alpha"}), -0.01)
    sure = answer("small", ("lookup", {"key": "alpha"}), -0.01)
    assert ladder_pick(LADDER, sure, large) == (sure, False)
    assert ladder_pick(LADDER, answer("small", ("lookup", {}), -2.0), large) == (large, True)
    assert ladder_pick(LADDER, answer("small", None, -0.01), large) == (large, True)
    # one unsure token under a sure mean: only the minimum signal escalates
    one_unsure = Answer("small", ("lookup", {"key": "alpha"}), None,
                        CallConfidence(-0.05, -2.5, 30), 1000, 900, 20)
    assert ladder_pick(ladder_at("mean", -0.07), one_unsure, large) == (one_unsure, False)
    assert ladder_pick(ladder_at("min", -2.0), one_unsure, large) == (large, True)
    assert ladder_pick(ladder_at("min", -3.0), one_unsure, large) == (one_unsure, False)
    # cost: computed prompt + completion + cached at its weight, times the parameters
    assert Engine("e", "u", params=10).cost(sure, 0.1) == 10 * (100 + 90 + 20)
    cfg = Path(str(tmp_path)) / "config.json"
    cfg.write_text(_json.dumps({"hidden_size": 4, "intermediate_size": 8,
                                "num_hidden_layers": 2}))
    assert non_embedding_params(cfg.parent) == 2 * (4 * 16 + 3 * 32 + 8)
    assert _finite({"a": [float("inf"), 1.0], "b": float("nan")}) == {"a": [None, 1.0],
                                                                       "b": None}
