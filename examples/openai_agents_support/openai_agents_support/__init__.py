"""An order-support agent written for the OpenAI Agents SDK on Temporal, run on
warmloop's gateway: the workflow and the agent are plain SDK code; only the worker's
client setup (``worker.connect``) names warmloop."""
