"""The shape glossary: one meaning per letter, for every shape suffix (`logits_BTV`) and every
shape in a docstring or annotation in the package. Modules refer here instead of restating it.

Model calls (grpo_jax.models):
- B  rows of one model call (a batch)
- T  tokens of a sequence (in decoding: the new tokens of a step)
- S  key slots (the cache's, or T in a plain pass)
- C  chunk slots (a chunk of the decode cache, or of the log-prob computation)
- X  rows and positions folded into one axis (B*T), for the projections
- E  embedding width; F MLP width; V vocabulary; L layers; Y layer kinds (full / sliding attention)
- H  query heads; K key/value heads; Q = H // K query heads per key/value head; D head width
- W  = Q*T query rows per key/value head in attention
- A  a LoRA adapter's rank; I and O a projection's input and output widths

GRPO batches (grpo_jax.rollout, grpo_jax.learner):
- N  prompts (groups) of a step
- G  the group size: samples per prompt
- R  = N*G rows; row i*G + j is sample j of prompt i
- P  prompt slots (the prompt bucket, left-padded)
- M  completion tokens (the sampler's max_new_tokens)

The paged engine's slots (grpo_jax.engine.paged; the per-slot layout: grpo_jax.engine.slots):
- Z  row shards (the mesh's data x fsdp x expert; 1 without a mesh), each with its own prompts, queue and slots
- J  decode slots per shard; Np prompts per shard; Rb = Np*G sequences per shard
- Mc a slot's capacity of fed tokens (max_new_tokens - 1, rounded up to whole attention phases)

The paged engine (grpo_jax.engine.paged, grpo_jax.engine.pages):
- Pg page ids per row shard (null page, prompt region, pool); Sg tokens per page (sampling.page_size)
- Tb page-table columns per slot (ceil((P + M) / Sg)); Tp pages of one prompt (ceil(P / Sg))

Mixture of experts (grpo_jax.models.experts):
- Ex experts of a layer; Fx an expert's MLP width (moe_intermediate_size); Kx experts per token
- Nx = X*Kx (token, expert) pairs, one per routing choice
- Pe devices along the mesh's `expert` axis; Le = Ex / Pe experts held by each (Ex without)
- Rg rows of a grouped matmul, sorted by expert (the Nx pairs, or a device's Mr received rows)
- Cb rows a device reserves for each peer in expert parallelism's exchange (Nx: the worst case);
  Mr = Pe*Cb rows it receives

Multi-turn episodes in the engine's slots (grpo_jax.episodes):
- U  the most environment tokens one answer may have (environment.max_env_tokens)
"""
