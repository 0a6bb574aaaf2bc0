"""The paged engine's allocator (grpo_jax.engine.pages, and `take_pages`, `seat` in
grpo_jax.engine.paged) against a plain-Python model of the same rules, on random traces of
admissions, growth, finishes and preemptions over two row shards: after every step the free stack,
its depth and every slot's private pages are the model's exactly, and no page is lost or held
twice."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.engine.pages import create_cache, prompt_table, push_pages
from grpo_jax.engine.layouts import take_pages

Z, J, NP, P, SG, M, POOL = 2, 5, 3, 6, 4, 24, 14  # shards, slots, prompts, prompt slots, page size, max new, pool pages


class Model:
    """One shard's allocator as the design says it works: a stack of free pages; a slot takes a page
    when its next key starts one (its first fed token always: the prompt's partial page is copied);
    when short, the youngest running slots give theirs back, the fewest that cover the shortfall."""

    def __init__(self, first: int, pool: int, prompt_len):
        self.free = list(range(first, first + pool))  # the stack: the top is the end
        self.n = prompt_len
        self.slot = [None] * J  # (prompt, t, stamp, {column: page})

    def push(self, j):
        prompt, t, stamp, pages = self.slot[j]
        self.free += [pages[c] for c in sorted(pages)]
        self.slot[j] = None

    def step(self, finish, going):
        for j in range(J):  # finished slots give their pages back, slot by slot
            if finish[j]:
                self.push(j)
        pos = {j: self.n[self.slot[j][0]] + self.slot[j][1] for j in range(J) if going[j]}
        need = {j for j in pos if pos[j] % SG == 0 or self.slot[j][1] == 0}
        short = len(need) - len(self.free)
        preempted = set()
        if short > 0:
            for j in sorted(pos, key=lambda j: -self.slot[j][2]):  # youngest first
                if short <= 0:
                    break
                preempted.add(j)
                short -= len(self.slot[j][3]) + (j in need)
            for j in sorted(preempted):
                self.push(j)
        for j in sorted(need - preempted):
            prompt, t, stamp, pages = self.slot[j]
            pages[pos[j] // SG] = self.free.pop()
        for j in pos:
            if j not in preempted:
                prompt, t, stamp, pages = self.slot[j]
                self.slot[j] = (prompt, t + 1, stamp, pages)
        return preempted


def test_the_allocator_is_its_python_model_on_random_traces():
    rng = np.random.default_rng(0)
    lengths = rng.integers(1, P + 1, size=(Z, NP))
    mask = np.arange(P)[None] >= P - lengths.reshape(-1)[:, None]  # left-padded prompts
    Tp = -(-P // SG)
    pages = 1 + NP * Tp + POOL
    cache = create_cache(jnp.zeros((1, Z * NP, 1, P, 1)), jnp.zeros((1, Z * NP, 1, P, 1)), jnp.asarray(mask),
                         shards=Z, slots=J, pages=pages, page_size=SG, max_new_tokens=M, layout="split")

    @jax.jit
    def step(cache, stamp, finish, going):
        cache = push_pages(cache, cache.held_pages() & finish[..., None])
        cache, _, preempted = take_pages(stamp, cache, going, going)
        going = going & ~preempted
        return cache.replace(slot_t=jnp.where(going, cache.slot_t + 1, 0)), preempted

    models = [Model(1 + NP * Tp, POOL, lengths[z]) for z in range(Z)]
    stamp, admitted, preemptions = np.zeros((Z, J), np.int32), 0, 0
    for i in range(120):
        # Admit into some empty slots (a new stamp each), as `paged.seat` does: the prompt's pages.
        slot_prompt, slot_t = np.asarray(cache.slot_prompt).copy(), np.asarray(cache.slot_t).copy()
        table = np.asarray(cache.table).copy()
        for z, m in enumerate(models):
            for j in range(J):
                if m.slot[j] is None and rng.random() < 0.5:
                    p = int(rng.integers(NP))
                    admitted += 1
                    m.slot[j] = (p, 0, admitted, {})
                    stamp[z, j], slot_prompt[z, j], slot_t[z, j] = admitted, p, 0
        cache = cache.replace(slot_prompt=jnp.asarray(slot_prompt), slot_t=jnp.asarray(slot_t))
        table = np.where(np.array([[m.slot[j] is not None and m.slot[j][1] == 0 for j in range(J)] for m in models])[
            ..., None], np.asarray(prompt_table(cache, cache.slot_prompt)), table)
        cache = cache.replace(table=jnp.asarray(table))
        busy = np.array([[m.slot[j] is not None for j in range(J)] for m in models])
        # Finish some; grow the rest; a sequence at max_new_tokens finishes.
        full = np.array([[m.slot[j] is not None and m.slot[j][1] + 1 >= M for j in range(J)] for m in models])
        finish = busy & ((rng.random((Z, J)) < 0.08) | full)
        going = busy & ~finish
        cache, preempted = step(cache, jnp.asarray(stamp), jnp.asarray(finish), jnp.asarray(going))
        table, nfree, free = np.asarray(cache.table), np.asarray(cache.nfree), np.asarray(cache.free)
        for z, m in enumerate(models):
            want = m.step(finish[z], going[z])
            assert set(np.flatnonzero(np.asarray(preempted)[z]).tolist()) == want, (i, z)
            preemptions += len(want)
            assert nfree[z] == len(m.free) and free[z, :nfree[z]].tolist() == m.free, (i, z)
            held = []
            for j in range(J):
                if m.slot[j] is not None:
                    for c, page in m.slot[j][3].items():
                        assert table[z, j, c] == page, (i, z, j, c)
                    held += list(m.slot[j][3].values())
            assert sorted(held + m.free) == list(range(1 + NP * Tp, 1 + NP * Tp + POOL)), (i, z)
    assert preemptions > 5 and admitted > 40
