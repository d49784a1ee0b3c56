"""The OpenAI-compatible HTTP server: request schemas, the engine's background loop, the app."""
