"""OpenAI-compatible HTTP server (FastAPI): api_server.build_app and run_server, routes in router.py,
the handlers in serving_completion.py and serving_chat.py; the command line is entrypoints/serve_cli.py."""
