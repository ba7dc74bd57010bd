"""Which replica gets a request: policies, the prefix index and block hashes, shared by the
server's in-process data parallelism and the gateway. Imports nothing that starts an engine."""
