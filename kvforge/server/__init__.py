"""OpenAI-compatible HTTP server: async engine loop, request validation, SSE streaming, metrics."""
