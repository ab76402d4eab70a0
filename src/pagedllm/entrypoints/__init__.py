"""Entry points: the offline LLM API, the command line and the OpenAI-compatible server."""
