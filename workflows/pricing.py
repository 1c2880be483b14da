"""What a step costs: a price table per model, cached input priced apart."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


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


# The tiny CPU model, priced as if its engine were a GPU at $0.80/h (an assumption, an
# L4-class card), at the throughput seen here: a 2,116-token prefix prefilled cold in
# ~100 ms (PLATFORM.md: ~20,000 tokens/s) and ~130 generated tokens/s per engine (vLLM's
# own log line during `make demo`). Real deployments add their model here; managed
# APIs at their list prices.
PRICES: dict[str, Pricing] = {
    "tiny": Pricing.self_hosted(gpu_usd_per_hour=0.80, prefill_tokens_per_s=20_000,
                                decode_tokens_per_s=130),
    "gpt-4o-mini": Pricing(input_per_m=0.15, cached_input_per_m=0.075, output_per_m=0.60),
}
DEFAULT_PRICING = PRICES["tiny"]


def pricing_for(model: str) -> Pricing:
    return PRICES.get(model, DEFAULT_PRICING)
