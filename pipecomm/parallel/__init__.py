"""Data and tensor parallelism around the pipeline: the device mesh, gradient reductions over replicas, FSDP stages."""
