"""warmloop: durable Temporal agent jobs on warm vLLM prefix caches."""
