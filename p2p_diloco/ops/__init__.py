"""Operating a run: bootstrap node, local swarm, checkpoints, metrics, process hygiene, fault injection."""
