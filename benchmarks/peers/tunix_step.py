"""Tunix's GRPOLearner on the peers workload (benchmarks/configs/peers.yaml); run in .venv-tunix.

    benchmarks/peers/.venv-tunix/bin/python benchmarks/peers/tunix_step.py --weights DIR --output OUT.json

One global step = 8 prompts x 8 completions of exactly 128 tokens (Tunix's vanilla rollout on
the actor's weights), rewards, the reference model's log-probs, one AdamW update over all 64
completions (mini batch = the whole batch, micro batch = --micro-batch-rows completions,
default all 64; rollout and reference log-probs over the whole batch). Timed by wrapping the learner's and the
cluster's own methods (each result is blocked on, so asynchronous dispatch cannot move time
between the parts):
  step_s    `GRPOLearner._run_global_step` (+ `RLCluster.sync_weights`, a no-op here: actor and
            rollout share one model)
  sample_s  `RLCluster.generate` (prefill + 128 decode steps over the 64 rows, detokenising)
  ref_s     `RLCluster.get_ref_per_token_logps`
  train_s   `RLCluster.update_actor` (policy forward + loss + backward + clip + AdamW)
  the rest of the step is Tunix's data path: rewards, advantages, queues, metrics.

Workarounds (each needed for this workload, see README.md):
  - the saved HF weights are loaded with Tunix's own llama3 safetensors loader (Tunix's Llama3
    constructor zero-initialises the MLP, so a fresh model is no random init);
  - Tunix's llama3 attention calls apply_rope without the config's rope_theta (it always uses
    1e6); the module-level function is patched to use the workload's 10000, so the model computes
    what transformers' Llama computes from the same weights;
  - the mesh's axes are made with AxisType.Auto (jax 0.10 defaults to Explicit, which Tunix's
    sharding annotations do not support);
  - no early stop: the rollout's stop token is an id outside the vocabulary (the sampler cannot
    produce it), so every completion runs the full 128 tokens.
"""

from __future__ import annotations

import functools
import importlib.metadata as md
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workload as w

# Never stop early: a stop id that the sampler cannot draw (ids are < VOCAB_SIZE).
NEVER_SAMPLED_STOP_ID = w.VOCAB_SIZE


def _load_models(weights: Path, mesh):
    import jax
    import jax.numpy as jnp
    from flax import nnx
    from tunix.models.llama3 import model as llama
    from tunix.models.llama3 import params as llama_params

    config = llama.ModelConfig(
        num_layers=w.NUM_LAYERS,
        vocab_size=w.VOCAB_SIZE,
        embed_dim=w.HIDDEN_SIZE,
        hidden_dim=w.INTERMEDIATE_SIZE,
        num_heads=w.NUM_HEADS,
        head_dim=w.HEAD_DIM,
        num_kv_heads=w.NUM_KV_HEADS,
        rope_theta=int(w.ROPE_THETA),
        norm_eps=w.RMS_NORM_EPS,
        weight_tying=False,
    )
    with jax.set_mesh(mesh):
        reference = llama_params.create_model_from_safe_tensors(str(weights), config, mesh, dtype=jnp.float32)
    graphdef, state = nnx.split(reference)
    actor = nnx.merge(graphdef, jax.tree.map(jnp.copy, state))
    return actor, reference


def _check_weights(weights: Path, model) -> None:
    """Every tensor of the checkpoint arrived in the Tunix model (none left at its init)."""
    import numpy as np
    from safetensors.numpy import load_file

    hf = load_file(str(weights / "model.safetensors"))
    checks = {
        "model.embed_tokens.weight": np.asarray(model.embedder.input_embedding[...]),
        "model.layers.0.mlp.gate_proj.weight": np.asarray(model.layers[0].mlp.gate_proj.kernel[...]).T,
        "model.layers.3.mlp.down_proj.weight": np.asarray(model.layers[3].mlp.down_proj.kernel[...]).T,
        "lm_head.weight": np.asarray(model.lm_head.w[...]).T,
        "model.layers.1.self_attn.q_proj.weight":
            np.asarray(model.layers[1].attn.q_proj.w[...]).reshape(w.HIDDEN_SIZE, -1).T,
    }
    for name, value in checks.items():
        if not np.allclose(hf[name], value):
            raise SystemExit(f"Tunix model's {name} differs from the checkpoint")


def main() -> None:
    args = w.parse_args(__doc__)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import jax
    import numpy as np
    import optax
    import transformers
    from flax import nnx
    from jax.sharding import AxisType
    from tunix.models.llama3 import model as llama
    from tunix.rl import rl_cluster as rl_cluster_lib
    from tunix.rl.grpo import grpo_learner
    from tunix.rl.rollout import base_rollout

    llama.apply_rope = functools.partial(llama.apply_rope, rope_theta=w.ROPE_THETA)

    total = args.warmup + args.steps
    tokenizer = transformers.AutoTokenizer.from_pretrained(args.weights)
    w.check_prompt_lengths(tokenizer, w.all_prompts(total))

    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(AxisType.Auto,) * 2)
    actor, reference = _load_models(args.weights, mesh)
    _check_weights(args.weights, reference)

    optimizer = optax.chain(
        optax.clip_by_global_norm(w.MAX_GRAD_NORM),
        optax.adamw(w.LEARNING_RATE, b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0),
    )
    cluster_config = rl_cluster_lib.ClusterConfig(
        role_to_mesh={rl_cluster_lib.Role.ACTOR: mesh, rl_cluster_lib.Role.REFERENCE: mesh,
                      rl_cluster_lib.Role.ROLLOUT: mesh},
        rollout_engine="vanilla",
        offload_to_cpu=False,
        training_config=rl_cluster_lib.RLTrainingConfig(
            actor_optimizer=optimizer,
            eval_every_n_steps=10_000,
            max_steps=total,
            mini_batch_size=w.PROMPTS_PER_STEP,
            # Prompts per forward/backward micro-batch (x G completions); gradients accumulate.
            train_micro_batch_size=args.micro_batch_rows // w.GROUP_SIZE,
            rollout_micro_batch_size=w.PROMPTS_PER_STEP,
            compute_logps_micro_batch_size=w.PROMPTS_PER_STEP,
            metrics_logging_options=None,
            pbar_description=None,
        ),
        rollout_config=base_rollout.RolloutConfig(
            max_tokens_to_generate=w.COMPLETION_LEN,
            max_prompt_length=w.PROMPT_LEN,
            kv_cache_size=w.PROMPT_LEN + w.COMPLETION_LEN,
            temperature=w.TEMPERATURE,
            top_p=1.0,
            top_k=None,
            eos_tokens=[NEVER_SAMPLED_STOP_ID],
            data_type=None,
        ),
    )
    cluster = rl_cluster_lib.RLCluster(actor=actor, reference=reference, tokenizer=tokenizer,
                                       cluster_config=cluster_config)
    algo = grpo_learner.GRPOConfig(
        num_generations=w.GROUP_SIZE,
        num_iterations=w.NUM_ITERATIONS,
        beta=w.BETA,
        epsilon=w.EPSILON,
        loss_agg_mode="token-mean",  # as grpo_jax's loss_agg: token_mean and TRL's "dapo"
    )

    def digit_share(prompts, completions, **kwargs):
        return [w.digit_share(c) for c in completions]

    learner = grpo_learner.GRPOLearner(rl_cluster=cluster, algo_config=algo, reward_fns=[digit_share])

    # Timers around Tunix's own methods.
    acc = {"sample": 0.0, "ref": 0.0, "train": 0.0, "sync": 0.0}
    rows = {"step": [], "sample": [], "ref": [], "train": []}
    lengths: set[int] = set()
    prompt_lengths: set[int] = set()

    def timed(key, fn, block=None):
        def wrapped(*a, **kw):
            t0 = time.perf_counter()
            out = fn(*a, **kw)
            jax.block_until_ready(out if block is None else block(out))
            acc[key] += time.perf_counter() - t0
            return out
        return wrapped

    generate = cluster.generate

    def generate_checked(*a, **kw):
        out = generate(*a, **kw)
        lengths.update(len(t) for t in out.tokens)
        prompt_lengths.update(int((row != tokenizer.pad_token_id).sum()) for row in out.left_padded_prompt_tokens)
        return out

    cluster.generate = timed("sample", generate_checked, block=lambda out: [t for t in out.tokens])
    cluster.get_ref_per_token_logps = timed("ref", cluster.get_ref_per_token_logps)
    update_actor = cluster.update_actor
    cluster.update_actor = timed("train", update_actor,
                                 block=lambda _: jax.tree.leaves(nnx.state(cluster.actor_trainer.model)))
    cluster.sync_weights = timed("sync", cluster.sync_weights)
    run_global_step = learner._run_global_step

    def global_step(*a, **kw):
        for k in acc:
            acc[k] = 0.0
        t0 = time.perf_counter()
        out = run_global_step(*a, **kw)
        rows["step"].append(time.perf_counter() - t0 + acc["sync"])
        for k in ("sample", "ref", "train"):
            rows[k].append(acc[k])
        i = len(rows["step"])
        print(f"step {i}{' (warm-up)' if i <= args.warmup else ''}: {rows['step'][-1]:.2f} s "
              f"(generate {acc['sample']:.2f}, ref {acc['ref']:.2f}, update {acc['train']:.2f})", flush=True)
        return out

    learner._run_global_step = global_step

    prompts = w.all_prompts(total)
    # Arrays, as Tunix's grain pipelines yield them: the learner repeats each field G times with
    # np.repeat over axis 0 (a list of strings would be mapped string by string).
    train_ds = [{"prompts": np.array(prompts[i * w.PROMPTS_PER_STEP:(i + 1) * w.PROMPTS_PER_STEP])}
                for i in range(total)]
    learner.train(train_ds)

    if lengths != {w.COMPLETION_LEN} or prompt_lengths != {w.PROMPT_LEN}:
        raise SystemExit(f"completion lengths {sorted(lengths)}, prompt lengths {sorted(prompt_lengths)}: "
                         f"expected {w.COMPLETION_LEN} and {w.PROMPT_LEN}")
    if len(rows["step"]) != total:
        raise SystemExit(f"timed {len(rows['step'])} steps, expected {total}")
    k = args.warmup
    step, sample, ref, train = (rows[n][k:] for n in ("step", "sample", "ref", "train"))
    rec = w.record("tunix", f"google-tunix {md.version('google-tunix')}, jax {jax.__version__}, "
                   f"flax {md.version('flax')}", step, sample, ref, train,
                   notes="train_s = RLCluster.update_actor; other_s = rewards, advantages, queues, metrics",
                   micro_batch_rows=args.micro_batch_rows)
    rec["other_s"] = [s - a - b - c for s, a, b, c in zip(step, sample, ref, train)]
    w.write_record(args.output, rec)


if __name__ == "__main__":
    main()
