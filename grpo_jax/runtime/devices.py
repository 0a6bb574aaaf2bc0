"""Where a run executes: the devices a config asks for, checked before anything compiles
(`check_devices`), the run's mesh (`run_mesh`) and the multi-host start (`initialize_distributed`)."""

from __future__ import annotations

import jax

from grpo_jax.config import ConfigError, MeshConfig, MoEConfig, RunConfig, check_micro_batches
from grpo_jax.runtime.sharding import make_mesh, mesh_devices, mesh_shape
from grpo_jax.config.rollout import ENGINE_TRAITS


def initialize_distributed(config: RunConfig) -> None:
    """`jax.distributed.initialize` when the config asks for it; must run before JAX touches a device."""
    d = config.distributed
    if not d.enabled:
        return
    jax.config.update("jax_cpu_collectives_implementation", d.cpu_collectives)
    kwargs = {k: v for k, v in (("coordinator_address", d.coordinator_address), ("num_processes", d.num_processes),
                                ("process_id", d.process_id)) if v is not None}
    jax.distributed.initialize(**kwargs)


def check_devices(config: RunConfig) -> None:
    """The mesh fits the devices and the batch splits over it (before anything compiles)."""
    pool = device_split(config)[1]  # the learner's devices
    if jax.process_count() > 1:
        if config.parallelism == "pmap":
            raise ConfigError(f"parallelism: pmap runs on one host; this run has {jax.process_count()} processes. "
                              "Use parallelism: jit with mesh.data: -1 for data parallelism across hosts")
        try:
            used = len(mesh_devices(config.mesh, pool))
        except ValueError as e:
            raise ConfigError(f"mesh: {e}") from None
        if used != len(pool):
            raise ConfigError(f"mesh: a multi-host mesh must use all {len(pool)} learner devices of the "
                              f"{jax.process_count()} processes, this one uses {used}; use -1 for one axis")
    if config.parallelism == "pmap":
        if config.mesh not in (MeshConfig(), MeshConfig(data=1, fsdp=1, expert=1, tensor=1)):
            raise ConfigError("parallelism: pmap replicates the model on every local device; it takes no mesh.* "
                              "settings (leave the mesh section out) -- use parallelism: jit for fsdp/expert/"
                              "tensor sharding")
        ways = jax.local_device_count()
    else:
        try:
            data, fsdp, expert, _ = mesh_shape(config.mesh, len(mesh_devices(config.mesh, pool)))
        except ValueError as e:
            raise ConfigError(f"mesh: {e}") from None
        ways = data * fsdp * expert
        samplers = config.rollout.sampler_devices
        if samplers and config.data.prompts_per_step % samplers:
            raise ConfigError(f"data.prompts_per_step={config.data.prompts_per_step} must be a multiple of "
                              f"rollout.sampler_devices={samplers} (the sampler splits the prompts over its devices)")
    if config.data.prompts_per_step % ways:
        raise ConfigError(f"data.prompts_per_step={config.data.prompts_per_step} must be a multiple of the "
                          f"{ways} ways the batch is split ({config.parallelism}: "
                          + ("local devices)" if config.parallelism == "pmap"
                             else "mesh.data x mesh.fsdp x mesh.expert)"))
    rows = config.data.prompts_per_step * config.sampling.group_size // ways
    try:
        check_micro_batches(rows, config.train.micro_batches, f"each of the {ways} batch shards")
    except ValueError as e:
        raise ConfigError(str(e)) from None
    prompts = config.data.prompts_per_step // ways
    if config.train.shared_prompt and prompts % config.train.micro_batches:
        raise ConfigError(f"train.shared_prompt runs each group's prompt once, so a micro-batch holds whole groups: "
                          f"each of the {ways} batch shards has {prompts} prompts, which train.micro_batches="
                          f"{config.train.micro_batches} does not divide; change micro_batches or set "
                          "train.shared_prompt: false")
    if config.sft.steps and config.sft.batch_size % ways:
        raise ConfigError(f"sft.batch_size={config.sft.batch_size} must be a multiple of the {ways} ways the "
                          "batch is split")


def device_split(config: RunConfig) -> tuple[list, list]:
    """(the sampler's devices, the learner's): with `rollout.sampler_devices` N, the first N / hosts
    local devices of every host go to the sampler and the rest to the learner, so both meshes span
    every host; without, the learner has every device and the sampler none of its own."""
    n = config.rollout.sampler_devices
    devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
    if not n:
        return [], jax.devices()
    hosts = jax.process_count()
    if n % hosts or n >= len(devices):
        raise ConfigError(f"rollout.sampler_devices={n}: give the sampler the same number of devices on each of the "
                          f"{hosts} hosts and leave the learner some of the {len(devices)}")
    per_host = n // hosts
    local = {p: [d for d in devices if d.process_index == p] for p in range(hosts)}
    sampler = [d for p in range(hosts) for d in local[p][:per_host]]
    return sampler, [d for p in range(hosts) for d in local[p][per_host:]]


def run_mesh(config: RunConfig):
    """The mesh a run trains on (and samples on, without `rollout.sampler_devices`): jit mode's
    (data, fsdp, expert, tensor) mesh over the learner's devices, or for pmap a data-only mesh over the
    local devices (the sampler's; the update itself is pmapped)."""
    if config.parallelism == "pmap":
        devices = jax.local_devices()
        return make_mesh(MeshConfig(data=len(devices)), devices)
    return make_mesh(config.mesh, mesh_devices(config.mesh, device_split(config)[1]))


def sampler_mesh(config: RunConfig):
    """The sampler's own mesh (`rollout.sampler_devices`: data-parallel over its devices, the
    weights replicated), or None when it samples on the learner's mesh."""
    devices = device_split(config)[0]
    return make_mesh(MeshConfig(data=len(devices), fsdp=1, expert=1, tensor=1), devices) if devices else None


def device_memory_bytes() -> tuple[int, str]:
    """(bytes all devices hold together, what that is): each accelerator's `bytes_limit`; on CPU
    the host's physical memory."""
    import os

    limits = [(d.memory_stats() or {}).get("bytes_limit") for d in jax.devices() if d.platform != "cpu"]
    if limits and all(limits):
        return int(sum(limits)), f"all {len(limits)} {jax.devices()[0].device_kind} devices together"
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "this host's memory"


def check_capacity(config: RunConfig, model_config, *, capacity: tuple[int, str] | None = None) -> None:
    """Refuse, before XLA is asked to allocate it, a batch whose sampler needs more memory than every
    device together holds: a lower bound (the keys and values of the sequences decoding at once at
    full length, and one step's logits) that XLA could only meet by aborting the process. A lower
    bound whatever the mesh: the paged engine (and continuous) decodes at least `slots` rows at once
    (per row shard, of which there is at least one), a paged pool holds at least `kv_cache_bytes`."""
    s, d, m = config.sampling, config.data, model_config
    rows = d.prompts_per_step * s.group_size
    slots, pages = ENGINE_TRAITS[s.engine]
    held = min(rows, s.slots) if slots and s.slots else rows  # rows decoding at once
    tokens = d.max_prompt_tokens + s.max_new_tokens
    itemsize = {"float32": 4, "bfloat16": 2}[config.model.dtype if config.model else "float32"]
    kv = held * tokens * m.num_layers * 2 * m.num_kv_heads * m.head_dim * itemsize
    if pages and s.kv_bytes:  # the pool holds what fits of them at once
        kv = min(kv, s.kv_bytes)
    logits = held * m.vocab_size * 4
    total, where = capacity or device_memory_bytes()
    if kv + logits > total:
        gib = 2**30
        raise ConfigError(
            f"this batch cannot fit: data.prompts_per_step {d.prompts_per_step} x sampling.group_size {s.group_size} "
            f"= {rows:,} sequences of up to {tokens} tokens need at least {(kv + logits) / gib:,.1f} GiB for their "
            f"keys and values ({kv / gib:,.1f} GiB) and one step's logits ({logits / gib:,.1f} GiB), more than the "
            f"{total / gib:,.1f} GiB of {where}; lower sampling.group_size, data.prompts_per_step or the lengths")


def check_moe(config: RunConfig, model_config) -> None:
    """A `moe:` section or an `expert` mesh axis needs a mixture-of-experts policy, and the axis must
    divide its experts (each device holds whole experts): refused before anything compiles."""
    if not model_config.is_moe:
        if config.moe != MoEConfig():
            raise ConfigError(f"moe: {config.moe} is set, but the policy is dense ({model_config.family}): remove "
                              "the moe section (it applies to mixture-of-experts models only)")
        if config.mesh.expert > 1:
            raise ConfigError(f"mesh.expert={config.mesh.expert} splits experts over devices, but the policy is "
                              f"dense ({model_config.family}): use data or fsdp instead")
        return
    if config.mesh.expert > 1 and model_config.num_experts % config.mesh.expert:
        raise ConfigError(f"mesh.expert={config.mesh.expert} does not divide the model's {model_config.num_experts} "
                          "experts; each device holds whole experts: choose a divisor")
