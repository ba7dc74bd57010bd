"""The prefill->decode KV hand-off. The names here are what the flags accept (no torch import)."""

KV_ROLES = ("both", "prefill", "decode")  # both: the colocated engine, no hand-off
TRANSPORTS = ("inproc", "tcp", "pg")  # transport/: in one process, any two hosts, torch.distributed
