"""Where a run executes: the device mesh and sharding rules, hosts, storage, device checks."""
