"""The swarm: DHT and roster, the canonical all-reduce, and the pure agreement and deadline rules."""
