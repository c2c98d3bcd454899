"""Process groups, device meshes, FSDP2 sharding and activation checkpointing."""
