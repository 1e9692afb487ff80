"""What both ends of lmtier's gRPC wire share (a sidecar and its clients, a peer
listener and the peer tier): status codes, chunk pieces, shared memory, the peer
proofs. Nothing here opens a cache or serves one."""
