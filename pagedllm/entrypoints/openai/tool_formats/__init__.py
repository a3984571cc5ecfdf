"""Tool-call formats of the models' replies, one module per format; the registry is ``tool_parsers``."""
