"""The gateway's own knobs. Routing, holding and batch admission take the fleet's
settings (``Settings.routing``, ``.holding``, ``.admission``): the gateway applies the
same policy as the workers, with the same weights."""

from __future__ import annotations

from pydantic import BaseModel, Field

from warmloop.workflows.holding import HoldPolicy


class GatewayConfig(BaseModel):
    refresh_s: float = Field(default=0.25, gt=0)
    """How often the registry snapshot that calls are routed by is read."""
    connect_timeout_s: float = Field(default=2.0, gt=0)
    """An engine that does not accept the connection in this long is passed over for
    the next one (a call is tried on each live engine at most once)."""
    read_timeout_s: float = Field(default=600.0, gt=0)
    """Longest wait for the engine's next bytes: a non-streamed call's whole answer, a
    stream's next event. A hung engine holds its calls this long."""
    failure_cooldown_s: float = Field(default=5.0, ge=0)
    """An engine that refused a call or died in one is set aside this long."""
    hold_policy: HoldPolicy = "cost_model"
    """cost_model (the workers' decide_hold), always_hold or never."""
    max_sessions: int = Field(default=50_000, ge=1)
    session_idle_s: float = Field(default=3600.0, gt=0)
    """A session without a call for this long is forgotten (its hold ends at its TTL)."""
    max_learned_prompts: int = Field(default=20_000, ge=1)
    """Prompt chains kept for calls without a session (least recently used go)."""
    learn_delay_s: float = Field(default=0.1, ge=0)
    """After-call work (tokenize, records, the hold decision) starts this long after the
    answer, and is dropped when the session's next call came meanwhile (that call's
    prompt extends this one's, and the pause it would decide on is over): back-to-back
    calls then do not pay for each other's bookkeeping."""
    learn_concurrency: int = Field(default=2, ge=1)
    """Prompts tokenized at once after their calls (on the engine that served each)."""
    max_learn_backlog: int = Field(default=256, ge=0)
    """Prompts waiting to be tokenized past which more are not learned (under a burst
    the engines serve calls first; a prompt not learned costs routing accuracy only)."""
    tail_tokens: int = Field(default=8, ge=0)
    """Tokens at a prompt's end not counted as reusable: the generation prompt, which
    the next call's rendering of the assistant's answer may not repeat."""
    keep_alive_s: int = Field(default=75, ge=1)
    """An idle client connection is kept open this long (uvicorn's ``timeout_keep_alive``).
    uvicorn's own default, 5 s, is what httpx (and so the OpenAI SDK) waits before it
    drops an idle connection itself, and shorter than a load balancer's idle timeout
    (60 s on AWS's ALB and in nginx's upstream keep-alive): the balancer or the client
    may then send a call on a connection the gateway is closing, and that call fails
    with no answer. Keep it longer than whatever sits in front of the gateway."""
    max_body_bytes: int = Field(default=32 * 1024 * 1024, ge=1024)
