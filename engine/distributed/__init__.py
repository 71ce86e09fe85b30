"""Beyond one device: tensor-parallel ranks (group.py, sharding.py, mirror.py, launch.py) and
data-parallel replicas behind sglang-router (data_parallel.py). docs/distributed.md says how to run them."""
