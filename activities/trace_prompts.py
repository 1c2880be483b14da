"""Inline system prompts of replayed traces, stored once in S3 under their content hash.

``warmloop replay`` puts each distinct inline prompt of a trace (with its tool schemas
and the trace's pauses per tool) here and names it in the job's profile field
(``trace:<hash>``). The inference worker resolves the name when it assembles a step's
prompt (cached per process), so workflow history never carries the prompt.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Any

from temporalio.exceptions import ApplicationError

from warmloop.workflows.profiles import Profile
from warmloop.workflows.trace import TRACE_PROFILE_PREFIX, InlinePrompt, trace_profile

UNKNOWN_TRACE_PROMPT = "UnknownTracePrompt"


def prompt_key(name: str) -> str:
    return f"trace-prompts/{name.removeprefix(TRACE_PROFILE_PREFIX)}.json"


class TracePromptStore:
    def __init__(self, s3: Any, bucket: str, *, cached: int = 256) -> None:
        self._s3 = s3
        self._bucket = bucket
        self._profiles: OrderedDict[str, Profile] = OrderedDict()
        self._cached = cached

    async def put(self, prompt: InlinePrompt) -> str:
        """Store ``prompt`` (again: the same bytes under the same key) and return its name."""
        name = prompt.name
        await asyncio.to_thread(self._s3.put_object, Bucket=self._bucket, Key=prompt_key(name),
                                Body=prompt.model_dump_json().encode(),
                                ContentType="application/json")
        return name

    async def profile(self, name: str) -> Profile:
        """The profile an inline prompt's steps are assembled with."""
        found = self._profiles.get(name)
        if found is not None:
            self._profiles.move_to_end(name)
            return found

        def get() -> bytes:
            try:
                obj = self._s3.get_object(Bucket=self._bucket, Key=prompt_key(name))
            except self._s3.exceptions.NoSuchKey:
                raise ApplicationError(
                    f"no inline prompt {name} in S3 ({prompt_key(name)}); `warmloop replay` "
                    "stores it before it starts the trace's jobs",
                    type=UNKNOWN_TRACE_PROMPT, non_retryable=True) from None
            return bytes(obj["Body"].read())

        prompt = InlinePrompt.model_validate_json(await asyncio.to_thread(get))
        if prompt.name != name:
            raise ApplicationError(f"inline prompt {name} in S3 does not hash to its name",
                                   type=UNKNOWN_TRACE_PROMPT, non_retryable=True)
        profile = trace_profile(name, prompt)
        self._profiles[name] = profile
        while len(self._profiles) > self._cached:
            self._profiles.popitem(last=False)
        return profile
