"""The prefill->decode KV hand-off."""
