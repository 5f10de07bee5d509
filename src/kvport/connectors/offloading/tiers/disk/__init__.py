"""The disk tier: run files of offload blocks under a shared directory, named per key by hard links.
Worker side (tier.py and what it uses) but for lookup.py, which the scheduler half calls."""
