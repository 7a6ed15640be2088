"""Serving many users: the scheduler that runs requests on the model, and the OpenAI-compatible server above it."""
