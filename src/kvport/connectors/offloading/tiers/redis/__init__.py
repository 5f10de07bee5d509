"""The Redis tier (Redis or Redis Cluster): one value per offload block. Worker side (tier.py) but
for lookup.py, which the scheduler half calls."""
