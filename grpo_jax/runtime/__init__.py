"""Where a run executes: the device mesh and the sharding rules (`sharding`: the axes and their
meaning are documented there, once), hosts and their rows (`hosts`), run directories and caches on
local or remote storage (`storage`), device checks and the run's meshes (`devices`), and the
device-to-device copy of parameters between meshes (`transfer`). Exported here: what the other
packages use."""

from grpo_jax.runtime.devices import check_devices, initialize_distributed, run_mesh, sampler_mesh
from grpo_jax.runtime.hosts import (RowShare, any_host, any_hosts, common_bucket, gather_json, gather_rows,
                                    is_primary, local_rows, max_over_hosts, multi_process, replicated_key, row_share,
                                    sum_over_shares, to_global)
from grpo_jax.runtime.sharding import (BATCH, RULES, batch_sharding, host_to_mesh, init_on_host, make_mesh,
                                       mesh_devices, mesh_or_one_device, on_mesh, one_device_mesh, param_shardings,
                                       place_model, pow2_bucket, replicate, replicated, round_to_row_shards,
                                       rows_per_shard, shard_rows, sharded_jit, split_rows, train_state_shardings,
                                       tree_shardings, unreplicate)
from grpo_jax.runtime.storage import RunDirectory, cache_dir, is_remote, local_copy
from grpo_jax.runtime.transfer import copy_to

__all__ = ["BATCH", "RULES", "RowShare", "RunDirectory", "any_host", "any_hosts", "batch_sharding", "cache_dir",
           "check_devices", "common_bucket", "copy_to", "gather_json", "gather_rows", "host_to_mesh", "init_on_host",
           "initialize_distributed", "is_primary", "is_remote", "local_copy", "local_rows", "make_mesh",
           "max_over_hosts", "mesh_devices", "mesh_or_one_device", "multi_process", "on_mesh", "one_device_mesh",
           "param_shardings", "place_model", "pow2_bucket", "replicate", "replicated", "replicated_key",
           "round_to_row_shards", "row_share", "rows_per_shard", "run_mesh", "sampler_mesh", "shard_rows",
           "sharded_jit", "split_rows", "sum_over_shares", "to_global", "train_state_shardings", "tree_shardings",
           "unreplicate"]
