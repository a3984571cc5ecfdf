"""OpenAI-compatible HTTP server (FastAPI): see api_server.build_app and run_server."""
