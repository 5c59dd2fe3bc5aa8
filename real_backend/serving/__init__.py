"""The HTTP server over the real engine: OpenAI-compatible front end, the engine thread's inbox,
Prometheus metrics, prompt and chat text (docs/serving.md)."""
