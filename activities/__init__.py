"""Everything with I/O: the vLLM client, the engine registry (Redis), tools and S3 storage."""
