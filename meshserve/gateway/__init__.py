"""The gateway: one OpenAI-compatible address in front of many replicas.

It routes each request (round robin, least load, or cache-aware), admits it only against KV capacity
the chosen replica's engine has reserved for it, queues fairly across tenants within their quotas
and deadlines, retries or resumes around failed replicas, and traces every request. It talks to
replicas over HTTP only: nothing here imports an engine.
"""
