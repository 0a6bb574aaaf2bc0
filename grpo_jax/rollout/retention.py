"""Retention: what RL costs the policy away from its task, measured at every evaluation.

A small general corpus (`GENERAL_CORPUS`, shipped: plain texts and prompt/response pairs that have
nothing to do with any training task; or `eval.retention_corpus`, a JSONL file of the same rows) is
scored teacher-forced:

- `retention/general_nll`: the policy's mean negative log-likelihood per target token (nats).
- `retention/kl`: KL(pi_0 || pi) per target position (nats), pi_0 the policy before the first
  update. pi_0's next-token distribution at each position is kept as its `top_k` most likely
  tokens' log-probs plus the rest of its mass in one bucket (`RetentionReference`, K values per
  position instead of a vocabulary's); the KL between the two bucketed distributions is a lower
  bound of the full KL (merging outcomes never raises a KL) and equals it when top_k >= V.

Both come from one jitted pass (`_retention_pass`), which also returns the current policy's own
top-k: the reference is that pass's output at step 0, so identical parameters give exactly 0.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from grpo_jax.learner.logprobs import completion_states
from grpo_jax.runtime.sharding import batch_sharding, host_to_mesh, replicated, round_to_row_shards

GENERAL_CORPUS = Path(__file__).resolve().parents[1] / "data" / "general_corpus.jsonl"
REFERENCE_FILE = "retention_reference.npz"  # in the run directory: pi_0's top-k, for a resumed run


@dataclasses.dataclass(frozen=True)
class Corpus:
    """Rows of context and target tokens: the target tokens are scored after their context."""

    context_ids: np.ndarray  # int32 [N, P], left-padded
    context_mask: np.ndarray  # int32 [N, P]
    target_ids: np.ndarray  # int32 [N, M], right-padded
    target_mask: np.ndarray  # float32 [N, M]: 1 where a target token is scored


@dataclasses.dataclass(frozen=True)
class RetentionReference:
    """pi_0's next-token distribution at each target position of a `Corpus`: its top-k tokens."""

    top_ids: np.ndarray  # int32 [N, M, K]
    top_logp: np.ndarray  # float32 [N, M, K], descending
    target_ids: np.ndarray  # int32 [N, M]: the corpus it was taken on (a resumed run's is compared)

    def save(self, path: Path) -> None:
        np.savez(path, top_ids=self.top_ids, top_logp=self.top_logp, target_ids=self.target_ids)

    @classmethod
    def load(cls, path: Path) -> RetentionReference:
        with np.load(path) as f:
            return cls(top_ids=f["top_ids"], top_logp=f["top_logp"], target_ids=f["target_ids"])


def read_rows(path: str | Path = GENERAL_CORPUS) -> list[dict]:
    """The corpus file's rows: each {"text": ...} or {"prompt": ..., "response": ...} (strings)."""
    rows = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e})") from None
        ok = isinstance(row, dict) and ((isinstance(row.get("text"), str) and row["text"]) or all(
            isinstance(row.get(k), str) and row[k] for k in ("prompt", "response")))
        if not ok:
            got = f"keys {sorted(row)}" if isinstance(row, dict) else f"a {type(row).__name__}"
            raise ValueError(f"{path}:{n}: a retention corpus row has a non-empty 'text', or 'prompt' and "
                             f"'response' strings; got {got}")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path} holds no rows")
    return rows


def _tokens(tokenizer, row: dict) -> tuple[list[int], list[int]]:
    """(context, target) ids of one row. A text is scored from its second token on (after its BOS
    where the tokenizer adds one); a response after its prompt, rendered by the chat template
    where the tokenizer has one."""
    if "text" in row:
        ids = tokenizer(row["text"])["input_ids"]
        return ids[:1], ids[1:]
    if getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": row["prompt"]}], tokenize=False,
                                             add_generation_prompt=True)
        context = tokenizer(text, add_special_tokens=False)["input_ids"]
    else:
        context = tokenizer(row["prompt"] + "\n\n")["input_ids"]
    return context, tokenizer(row["response"], add_special_tokens=False)["input_ids"]


def build_corpus(tokenizer, rows: list[dict], *, max_tokens: int = 128, mesh: Mesh | None = None) -> Corpus:
    """`rows` tokenized: contexts left-padded, targets cut to their first `max_tokens` tokens and
    right-padded (widths rounded up to 8, rows up to the mesh's row shards with empty rows)."""
    pairs = [_tokens(tokenizer, r) for r in rows]
    pairs = [(c, t[:max_tokens]) for c, t in pairs if c and t]
    if not pairs:
        raise ValueError("no retention corpus row has a token to score")
    n = round_to_row_shards(len(pairs), mesh)
    P = -(-max(len(c) for c, _ in pairs) // 8) * 8
    M = -(-max(len(t) for _, t in pairs) // 8) * 8
    out = Corpus(np.zeros((n, P), np.int32), np.zeros((n, P), np.int32), np.zeros((n, M), np.int32),
                 np.zeros((n, M), np.float32))
    for i, (c, t) in enumerate(pairs):
        out.context_ids[i, P - len(c):], out.context_mask[i, P - len(c):] = c, 1
        out.target_ids[i, :len(t)], out.target_mask[i, :len(t)] = t, 1.0
    out.context_mask[len(pairs):, -1] = 1  # an empty row attends to one (pad) token: no NaN in its pass
    return out


def bucketed_kl(ref_top_logp: jax.Array, ref_top_ids: jax.Array, logp: jax.Array) -> jax.Array:
    """KL(p0 || p) [...] with p0 known by its top-k (`ref_top_logp`, `ref_top_ids` [..., K]) and
    p by its full log-probs `logp` [..., V]: both coarsened to those K tokens plus one bucket for
    the rest. A lower bound of KL(p0 || p), exact when the K tokens hold all of p0's mass."""
    logp_k = jnp.take_along_axis(logp, ref_top_ids, axis=-1)
    both = jnp.stack([ref_top_logp, logp_k])  # one exp and one sum for both: equal inputs, equal masses
    mass = jnp.exp(both)
    rest = jnp.clip(1.0 - jnp.sum(mass, axis=-1), 0.0, 1.0)
    rest0, rest1 = rest[0], jnp.maximum(rest[1], 1e-30)
    terms = jnp.sum(mass[0] * (both[0] - both[1]), axis=-1)
    tail = jnp.where(rest0 > 0, rest0 * (jnp.log(jnp.maximum(rest0, 1e-30)) - jnp.log(rest1)), 0.0)
    return terms + tail


def _retention_pass(params, context_ids, context_mask, target_ids, target_mask, ref_top_ids, ref_top_logp, *,
                    graphdef, k: int, chunk: int, row_sharding):
    """(sum of target NLL, sum of bucketed KL to the reference, target tokens, this policy's top-k
    ids [N, M, K], their log-probs [N, M, K]) over the corpus, logits made a chunk of positions at a time."""
    model = nnx.merge(graphdef, params)
    h_NME = completion_states(model, context_ids, context_mask, target_ids, row_sharding=row_sharding)
    N, M, E = h_NME.shape
    C = min(chunk, M)
    n = -(-M // C)
    pad = lambda x: jnp.pad(x, [(0, 0), (0, n * C - M)] + [(0, 0)] * (x.ndim - 2))  # noqa: E731
    cut = lambda x: pad(x).reshape(N, n, C, *x.shape[2:]).swapaxes(0, 1)  # noqa: E731

    def one(xs):
        h, t, m, ref_ids, ref_logp = xs
        logp = jax.nn.log_softmax(model.logits(h).astype(jnp.float32), axis=-1)
        nll = -jnp.take_along_axis(logp, t[..., None], axis=-1)[..., 0]
        kl = bucketed_kl(ref_logp, ref_ids, logp)
        top_logp, top_ids = jax.lax.top_k(logp, k)
        return jnp.sum(nll * m), jnp.sum(kl * m), top_ids.astype(jnp.int32), top_logp

    nll, kl, top_ids, top_logp = jax.lax.map(one, tuple(map(cut, (h_NME, target_ids, target_mask, ref_top_ids,
                                                                   ref_top_logp))))
    whole = lambda x: x.swapaxes(0, 1).reshape(N, n * C, k)[:, :M]  # noqa: E731
    return nll.sum(), kl.sum(), target_mask.sum(), whole(top_ids), whole(top_logp)


@functools.lru_cache(maxsize=8)
def _jitted(graphdef, mesh: Mesh, k: int, chunk: int):
    """The pass jitted once per (model structure, mesh, k, chunk); the inputs come placed (the
    parameters by the rules, the rows split over the mesh), the sums and top-k replicated."""
    fn = functools.partial(_retention_pass, graphdef=graphdef, k=k, chunk=chunk, row_sharding=batch_sharding(mesh, 1))
    return jax.jit(fn, out_shardings=(replicated(mesh),) * 5)


class Retention:
    """A run's retention probe: `reference(model)` once on pi_0, then `metrics(model)` at each
    evaluation. `k`: eval.retention_top_k (at most the vocabulary)."""

    def __init__(self, corpus: Corpus, *, mesh: Mesh, k: int = 64, chunk: int = 64):
        self.corpus, self.mesh, self.k, self.chunk = corpus, mesh, k, chunk
        self.ref: RetentionReference | None = None
        self._placed: tuple = (None, [])  # (the reference they hold, the pass's inputs on the mesh)

    def _run(self, model, ref: RetentionReference | None):
        graphdef, params = nnx.split(model, nnx.Param)
        k = min(self.k, model.config.vocab_size)
        c = self.corpus
        N, M = c.target_ids.shape
        if ref is None:  # no reference yet: the pass's KL is ignored (its top-k becomes the reference)
            ref = RetentionReference(np.zeros((N, M, k), np.int32), np.zeros((N, M, k), np.float32), c.target_ids)
        if self._placed[0] is not ref:  # the corpus and the reference go to the mesh once, not every evaluation
            rows = batch_sharding(self.mesh, 1)
            self._placed = (ref, [host_to_mesh(np.asarray(x), rows) for x in (
                c.context_ids, c.context_mask, c.target_ids, c.target_mask, ref.top_ids, ref.top_logp)])
        step = _jitted(graphdef, self.mesh, k, self.chunk)
        return step(params, *self._placed[1])

    def reference(self, model) -> RetentionReference:
        """pi_0's top-k at every target position (kept as `self.ref`)."""
        *_, ids, logp = self._run(model, None)
        self.ref = RetentionReference(np.asarray(ids), np.asarray(logp), self.corpus.target_ids)
        return self.ref

    def begin(self, model, run_dir: Path, *, resumed: bool, primary: bool, log) -> None:
        """A run's start. A fresh run, before its first update: `model` is pi_0, whose reference goes
        to `run_dir/REFERENCE_FILE` (written by process 0) for the run's resumptions and `grpo-jax
        eval`. A resumed run reads it back (`load`)."""
        if resumed:
            self.load(run_dir, log=log)
            return
        self.reference(model)
        if primary:
            self.ref.save(Path(run_dir) / REFERENCE_FILE)

    def load(self, run_dir: Path, *, log) -> None:
        """pi_0's reference as the run saved it (process 0 reads it; every process receives it). A
        run directory without one (the run started without eval.retention) gives no retention/kl:
        one line to `log` says so."""
        path = Path(run_dir) / REFERENCE_FILE
        found = bool(_from_first_process(np.asarray(path.exists() if jax.process_index() == 0 else False)))
        if not found:
            log(f"retention/kl is not measured: {path} is missing (the run did not start with eval.retention, "
                "so its first policy's distribution was not kept); retention/general_nll is")
            return
        ref = RetentionReference.load(path) if jax.process_index() == 0 else None
        shape = tuple(int(x) for x in _from_first_process(np.asarray(ref.top_ids.shape if ref else (0, 0, 0))))
        if ref is None:  # every process takes process 0's arrays, in their shape
            ref = RetentionReference(np.zeros(shape, np.int32), np.zeros(shape, np.float32),
                                     np.zeros(shape[:2], np.int32))
        ref = RetentionReference(*(np.asarray(_from_first_process(x)) for x in (ref.top_ids, ref.top_logp,
                                                                                 ref.target_ids)))
        c = self.corpus
        N, M = c.target_ids.shape
        real = int((c.target_mask.sum(axis=1) > 0).sum())
        if ref.target_ids.shape[1] != M or ref.target_ids.shape[0] < real or (
                ref.target_ids[:real] != c.target_ids[:real]).any() or ref.target_ids[real:].any():
            raise ValueError(f"{path} was kept on another retention corpus than this config's (eval.retention_corpus, "
                             "eval.retention_max_tokens and the tokenizer must be the run's own)")
        # Rows past the real ones pad the corpus to the mesh's row shards: another mesh pads to another count.
        rows = lambda x: np.pad(x[:N], [(0, max(0, N - x.shape[0]))] + [(0, 0)] * (x.ndim - 1))  # noqa: E731
        self.ref = RetentionReference(rows(ref.top_ids), rows(ref.top_logp), c.target_ids)

    def metrics(self, model) -> dict[str, float]:
        """`retention/general_nll` and (with pi_0's reference) `retention/kl` of `model`, in nats per
        target token."""
        nll, kl, n, _, _ = self._run(model, self.ref)
        n = float(n)
        out = {"retention/general_nll": float(nll) / n, "retention/tokens": n}
        if self.ref is not None:
            out["retention/kl"] = float(kl) / n
        return out


def _from_first_process(x: np.ndarray) -> np.ndarray:
    """Process 0's `x` on every process (itself with one process)."""
    if jax.process_count() == 1:
        return x
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.broadcast_one_to_all(x))
