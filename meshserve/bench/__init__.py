"""Serving benchmark: load generation against any OpenAI-compatible server over HTTP.

Nothing here imports the meshserve engine; the benchmark measures a server only through
its HTTP surface (`/v1/completions`, `/v1/chat/completions`, `/tokenize`, `/v1/models`).
"""
