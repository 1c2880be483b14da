"""What a step costs: each engine declares its price (``EnginePrice``), cached input
priced apart. The inference worker beside the engine prices each step it serves."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Pricing(BaseModel):
    """Dollars per million tokens."""

    model_config = ConfigDict(frozen=True)

    input_per_m: float = Field(ge=0)
    cached_input_per_m: float = Field(ge=0)
    output_per_m: float = Field(ge=0)

    @classmethod
    def self_hosted(cls, *, gpu_usd_per_hour: float, prefill_tokens_per_s: float,
                    decode_tokens_per_s: float, cached_fraction: float = 0.1) -> Pricing:
        """Price a self-hosted engine from its GPU's hourly cost and measured throughput.

        An uncached input token costs one prefill-token of GPU time; a cached one costs
        ``cached_fraction`` of that (a lookup and attention over it, no recompute);
        an output token costs one decode-token of GPU time.
        """
        per_s = gpu_usd_per_hour / 3600
        input_per_m = per_s / prefill_tokens_per_s * 1e6
        return cls(input_per_m=input_per_m, cached_input_per_m=input_per_m * cached_fraction,
                   output_per_m=per_s / decode_tokens_per_s * 1e6)

    def cost(self, *, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> float:
        uncached = max(0, prompt_tokens - cached_tokens)
        return (uncached * self.input_per_m + cached_tokens * self.cached_input_per_m
                + completion_tokens * self.output_per_m) / 1e6


SELF_HOSTED_FIELDS = ("gpu_usd_per_hour", "prefill_tokens_per_s", "decode_tokens_per_s")
PER_TOKEN_FIELDS = ("input_usd_per_mtok", "cached_input_usd_per_mtok", "output_usd_per_mtok")


class EnginePrice(BaseModel):
    """What one engine's tokens cost, declared with the engine (``"price"`` in
    ``WARMLOOP_ENGINES``). Exactly one kind:

    - self-hosted: ``gpu_usd_per_hour``, ``prefill_tokens_per_s`` and
      ``decode_tokens_per_s`` (converted by ``Pricing.self_hosted``);
    - per token: ``input_usd_per_mtok``, ``cached_input_usd_per_mtok`` and
      ``output_usd_per_mtok`` (a managed API's list price).
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    gpu_usd_per_hour: float | None = Field(default=None, gt=0, le=1_000)
    """Self-hosted: what the engine's GPUs cost per hour, all of them together."""
    prefill_tokens_per_s: float | None = Field(default=None, gt=0, le=10_000_000)
    """Self-hosted: the engine's measured prefill throughput (uncached prompt tokens/s)."""
    decode_tokens_per_s: float | None = Field(default=None, gt=0, le=10_000_000)
    """Self-hosted: the engine's measured decode throughput (generated tokens/s, all
    sequences together)."""
    cached_fraction: float | None = Field(default=None, ge=0, le=1)
    """Self-hosted: a cached input token's cost as a share of an uncached one's (a lookup
    and attention over it, no recompute); None: 0.1."""
    input_usd_per_mtok: float | None = Field(default=None, ge=0, le=1_000)
    """Per token: dollars per million uncached input tokens."""
    cached_input_usd_per_mtok: float | None = Field(default=None, ge=0, le=1_000)
    """Per token: dollars per million input tokens read from the prompt cache."""
    output_usd_per_mtok: float | None = Field(default=None, ge=0, le=1_000)
    """Per token: dollars per million output tokens."""

    @model_validator(mode="after")
    def _one_kind(self) -> EnginePrice:
        hosted = [f for f in SELF_HOSTED_FIELDS if getattr(self, f) is not None]
        token = [f for f in PER_TOKEN_FIELDS if getattr(self, f) is not None]
        either = (f"either a self-hosted price ({', '.join(SELF_HOSTED_FIELDS)}) or a "
                  f"per-token price ({', '.join(PER_TOKEN_FIELDS)})")
        if hosted and token:
            raise ValueError(f"give {either}, not both (got {hosted[0]} and {token[0]})")
        if not hosted and not token:
            raise ValueError(f"give {either}")
        given, needed = (hosted, SELF_HOSTED_FIELDS) if hosted else (token, PER_TOKEN_FIELDS)
        missing = [f for f in needed if f not in given]
        if missing:
            kind = "self-hosted" if hosted else "per-token"
            raise ValueError(f"a {kind} price needs {', '.join(needed)}; "
                             f"missing: {', '.join(missing)}")
        if token and self.cached_fraction is not None:
            raise ValueError("cached_fraction belongs to a self-hosted price; a per-token "
                             "price gives cached_input_usd_per_mtok instead")
        return self

    @property
    def kind(self) -> Literal["self_hosted", "per_token"]:
        return "self_hosted" if self.gpu_usd_per_hour is not None else "per_token"

    @property
    def pricing(self) -> Pricing:
        """Dollars per million tokens of each kind."""
        if self.kind == "self_hosted":
            assert (self.gpu_usd_per_hour is not None and self.prefill_tokens_per_s is not None
                    and self.decode_tokens_per_s is not None)
            return Pricing.self_hosted(
                gpu_usd_per_hour=self.gpu_usd_per_hour,
                prefill_tokens_per_s=self.prefill_tokens_per_s,
                decode_tokens_per_s=self.decode_tokens_per_s,
                cached_fraction=0.1 if self.cached_fraction is None else self.cached_fraction)
        assert (self.input_usd_per_mtok is not None and self.output_usd_per_mtok is not None
                and self.cached_input_usd_per_mtok is not None)
        return Pricing(input_per_m=self.input_usd_per_mtok,
                       cached_input_per_m=self.cached_input_usd_per_mtok,
                       output_per_m=self.output_usd_per_mtok)

    def cost(self, *, prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> float:
        """Dollars for one step's tokens (the engine's own usage figures)."""
        return self.pricing.cost(prompt_tokens=prompt_tokens, cached_tokens=cached_tokens,
                                 completion_tokens=completion_tokens)


# Replay only: before engines declared their prices, the workflow priced each step by
# its model's name from this table, falling back on the tiny model's price for any
# model it did not know. AgentJob still needs it to replay histories recorded then
# (patch "engine-prices"); new runs use GenerateResult.cost_usd, priced by the engine's
# worker. Remove both once no such workflow can be replayed.
PRICES: dict[str, Pricing] = {
    "tiny": Pricing.self_hosted(gpu_usd_per_hour=0.80, prefill_tokens_per_s=20_000,
                                decode_tokens_per_s=130),
    "gpt-4o-mini": Pricing(input_per_m=0.15, cached_input_per_m=0.075, output_per_m=0.60),
}
DEFAULT_PRICING = PRICES["tiny"]


def pricing_for(model: str) -> Pricing:
    """Replay only (see PRICES): the price the workflow used before engines declared one."""
    return PRICES.get(model, DEFAULT_PRICING)
