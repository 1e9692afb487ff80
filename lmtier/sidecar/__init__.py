"""`lmtier serve`: the gRPC sidecar that serves the tiers to engines in other processes."""
