"""A training run inside the daemon, in pieces with one job each (peerd.node.run.run lists them)."""
