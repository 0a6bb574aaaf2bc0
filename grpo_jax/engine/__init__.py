"""The decode engine (the actor's device side): `generate(model, prompts, config, rng) -> Rollout`
with one shared prefill per group, the engines as objects chosen once by `sampling.engine`
(`engines`), the static lock-step loop (`lockstep`), the production engine (`paged`: decode slots
refilled on device, the drain) over its two cache layouts (`layouts`: a page pool, `pages`, read by
`paged_decode`; or one reservation per slot, `slots`), its layout of rows (`state`), how a token is drawn (`draw`) and which experts a mixture-of-experts model sent each
token to (`routing`). A call without a mesh runs on a 1x1x1 mesh,
through the same code. It knows nothing of rewards, environments or the learner."""

from grpo_jax.engine.draw import Rollout
from grpo_jax.engine.sampling import generate, pad_prompts

__all__ = ["Rollout", "generate", "pad_prompts"]
