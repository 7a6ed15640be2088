"""Serving: the decode engine with slots, the scheduler, the prefix cache and the OpenAI-compatible server."""
