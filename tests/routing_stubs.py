"""A prefix directory that knows nothing, for the routing activity's unit tests: every
job is new, no profile's prefix is cached anywhere."""

from __future__ import annotations


class EmptyDirectory:
    async def job_chain(self, job_id: str) -> None:
        return None

    async def profile_chain(self, family: str) -> None:
        return None

    async def matched_blocks(self, chain: list[str], ids: list[str]) -> dict[str, int]:
        return dict.fromkeys(ids, 0)
