"""Model FLOPs of a GRPO step, for MFU: matmul FLOPs (2 per multiply-add) of the work the step does.

Counted per token and layer: the q, k, v and o projections, the gated MLP (gate, up, down), and
attention (scores and the weighted sum: 4 x heads x head_dim per attended key; a causal token
attends itself and the tokens before it, a sliding-window one at most `window` of them); plus the
lm head for the positions whose logits are computed. Norms, rotary embeddings, softmax and the
optimizer are left out (a few percent at most). The backward pass counts as twice the forward.

A step (`step_flops`): the sampler's prefill (the N prompts once, logits at the last position) and
its decode steps (R = N x G rows, each attending the prompt and what it generated so far); the
reference pass (beta > 0) and the update's forward, the update counted 3x. With
`train.shared_prompt` that forward runs the N prompts once and the R completions after them;
without it, every row's own prompt copy and completion. Either way the lm head runs at the M
positions that predict each row's completion tokens.
"""

from __future__ import annotations

import dataclasses

from grpo_jax.models.config import TransformerConfig


def _attended(start: int, count: int, window: int | None) -> int:
    """Keys attended by `count` consecutive tokens at positions start .. start+count-1 (causal)."""
    total = 0
    for pos in range(start, start + count):
        total += min(pos + 1, window) if window else pos + 1
    return total


def _layer_windows(cfg: TransformerConfig) -> list[int | None]:
    return [cfg.window_of(kind) for kind in cfg.layer_types]


def forward_flops(cfg: TransformerConfig, *, rows: int, start: int, count: int, logits: int) -> float:
    """FLOPs of `rows` rows each running `count` tokens at positions start .. start+count-1 (the
    first `start` positions already cached), with logits computed at `logits` positions per row."""
    E, H, K, D, F, V = (cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.intermediate_size,
                        cfg.vocab_size)
    # A mixture of experts: each token's top-k experts' MLPs, and the router (a mixed stack's dense
    # layers: the dense MLP).
    sparse = len(cfg.sparse_layers)
    moe = 3 * 2 * E * cfg.moe_intermediate_size * cfg.num_experts_per_tok + 2 * E * cfg.num_experts
    mlp = sparse * moe + (cfg.num_layers - sparse) * 3 * 2 * E * F
    per_token = cfg.num_layers * (2 * E * (H + 2 * K) * D + 2 * H * D * E) + mlp
    attention = sum(4 * H * D * _attended(start, count, w) for w in _layer_windows(cfg))
    return float(rows * (count * per_token + attention + logits * 2 * E * V))


@dataclasses.dataclass(frozen=True)
class StepFlops:
    sample: float  # prefill + decode
    reference: float  # 0 when beta == 0
    update: float  # forward + backward (3x forward), times num_iterations

    @property
    def total(self) -> float:
        return self.sample + self.reference + self.update


def step_flops(cfg: TransformerConfig, *, prompts: int, group_size: int, prompt_len: int, completion_len: int,
               decode_steps: int | None = None, reference: bool = True, num_iterations: int = 1,
               shared_prompt: bool = True) -> StepFlops:
    """FLOPs of one GRPO step: `prompts` x `group_size` rows, prompts padded to `prompt_len`,
    completions of `completion_len` slots (the train step computes all of them), and
    `decode_steps` decode steps run by the sampler (default completion_len - 1: no early stop)."""
    N, G, P, M = prompts, group_size, prompt_len, completion_len
    steps = M - 1 if decode_steps is None else decode_steps
    prefill = forward_flops(cfg, rows=N, start=0, count=P, logits=1)
    decode = sum(forward_flops(cfg, rows=N * G, start=P + t, count=1, logits=1) for t in range(steps))
    if shared_prompt:
        one_pass = (forward_flops(cfg, rows=N, start=0, count=P, logits=0)
                    + forward_flops(cfg, rows=N * G, start=P, count=M, logits=M))
    else:
        one_pass = forward_flops(cfg, rows=N * G, start=0, count=P + M, logits=M)
    return StepFlops(sample=prefill + decode, reference=one_pass if reference else 0.0,
                     update=3 * one_pass * num_iterations)
