"""The host's side of the episodes in the engine's slots, between segments (grpo_jax.episodes.runner
drives it): it reads which slots' turns ended, hands each ended turn to its episode (whose
environment steps on its own thread), feeds the environment's answers back, ends episodes, cuts
turns at a tool call's closing tag, and moves episodes whose environment is slow out of their slot
and back (grpo_jax.episodes.turns `move_slots`).

Slots are per row shard of the mesh (Z shards x J slots); shard z holds episodes z*Rb .. z*Rb+Rb-1
(Rb per shard), and an episode parks and comes back within its shard.
"""

from __future__ import annotations

import numpy as np

from grpo_jax.episodes.turns import PAUSED


class Answers:
    """The arrays of one poll: for `host_update` and for `move_slots`."""

    def __init__(self, Z: int, J: int, U: int):
        self.release, self.forced = np.zeros((Z, J), bool), np.zeros((Z, J, U), np.int32)
        self.n, self.rewind = np.zeros((Z, J), np.int32), np.full((Z, J), -1, np.int32)
        self.park_to, self.load_from = np.full((Z, J), -1, np.int32), np.full((Z, J), -1, np.int32)
        self.ended = np.zeros((Z, J), bool)  # parked episodes the host ended, by spot

    def feed(self, z: int, j: int, ids) -> None:
        self.forced[z, j, :len(ids)], self.n[z, j] = ids, len(ids)

    @property
    def update_args(self) -> tuple:
        return self.release, self.forced, self.n, self.rewind

    @property
    def move_args(self) -> tuple | None:
        moved = (self.park_to >= 0).any() or (self.load_from >= 0).any() or self.ended.any()
        return (self.park_to, self.load_from, self.ended) if moved else None

    @property
    def quiet(self) -> bool:
        """Nothing for the engine: no slot released, fed, rewound or moved."""
        return not (self.release.any() or (self.n > 0).any() or (self.rewind >= 0).any()) and self.move_args is None


class EpisodeHost:
    """Per episode: where its current turn starts, the environment call in flight and the poll it
    started at, and for a parked episode its spot, its position and its answer waiting for a slot.
    `park`: move an episode out of its slot when its environment is still working one poll after
    its turn ended and other episodes of its shard wait for a slot."""

    def __init__(self, episodes, tokenizer, stop_ids, env_tokens: int, *, shards: int = 1, park: bool = True):
        self.episodes, self.tokenizer, self.stop_ids, self.U = episodes, tokenizer, set(stop_ids), env_tokens
        self.Rb = len(episodes) // shards
        self.turn_start = [0] * len(episodes)
        self.calls, self.since = {}, {}
        self.park, self.parks, self.polls = park, 0, 0
        self.parked, self.parked_t = {}, {}
        self.ready = [{} for _ in range(shards)]  # per shard: episode -> the tokens to feed on loading

    def answer(self, ts) -> Answers:
        """What the engine is told after a segment (`turns.host_update`, `turns.move_slots`; `ts`
        the continuous or the paged engine's turn state, read through its `host_view`)."""
        self.polls += 1
        st = ts.engine
        seq, mode, t, queued = (np.asarray(x) for x in ts.host_view())
        Z, J = seq.shape
        out = Answers(Z, J, self.U)
        self._poll_parked(out.ended)
        trajectories = []

        def rows():  # the generated tokens and log-probs of every episode, read once per poll if needed
            if not trajectories:
                trajectories.extend(np.asarray(x).reshape(-1, x.shape[-1]) for x in (st.tokens, st.logprobs))
            return tuple(trajectories)

        for z in range(Z):
            waiting = bool(queued[z]) or bool(self.ready[z])
            taken = {s for r, s in self.parked.items() if r // self.Rb == z}
            spots = [s for s in range(J) if s not in taken]
            for j in np.flatnonzero(seq[z] >= 0):
                r = z * self.Rb + int(seq[z, j])
                self._slot(out, z, int(j), r, int(t[z, j]), bool(mode[z, j] == PAUSED), rows,
                           spots if self.park and waiting else [])
            # Answered parked episodes go back into the free slots and those just vacated.
            for j in [*np.flatnonzero(seq[z] < 0), *np.flatnonzero(out.park_to[z] >= 0)]:
                if not self.ready[z]:
                    break
                r = next(iter(self.ready[z]))  # the longest waiting first
                fed = self.ready[z].pop(r)
                out.load_from[z, j] = self.parked.pop(r)
                out.feed(z, j, fed)
                self.turn_start[r] = self.parked_t.pop(r) + len(fed)
        return out

    def _slot(self, out: Answers, z: int, j: int, r: int, t: int, paused: bool, rows, spots: list) -> None:
        """One occupied slot: its environment's answer, its turn's end, or (slow environment) its move."""
        ep = self.episodes[r]
        if r in self.calls:
            if not self.calls[r].ready(ep.limits.timeout_s):
                if spots and self.since[r] < self.polls:
                    out.park_to[z, j] = self.parked[r] = spots.pop(0)
                    self.parked_t[r], self.parks = t, self.parks + 1
                return
            fed = ep.respond(self.calls.pop(r))
            if fed is None:
                out.release[z, j] = True
            else:
                out.feed(z, j, fed)
                self.turn_start[r] = t + len(fed)
            return
        if ep.error is not None:
            out.release[z, j] = True
            return
        tokens, logprobs = rows()
        end = self._turn_end(r, t, paused, tokens[r])
        if end is None:
            return
        cut = end < t  # at the tool call's closing tag, not at a stop token
        if cut:
            out.rewind[z, j] = end
        turn = tokens[r, self.turn_start[r]:end]
        call = ep.add_turn(turn.tolist(), logprobs[r, self.turn_start[r]:end].tolist(),
                           stopped=not cut and bool(turn.size) and int(turn[-1]) in self.stop_ids)
        if call is None:
            out.release[z, j] = True
        else:
            self.calls[r], self.since[r] = call, self.polls

    def _poll_parked(self, ended: np.ndarray) -> None:
        """Answer the parked episodes whose environment is done: those that ended are marked in
        `ended` (bool [Z, J], by spot: free again), the others' tokens wait in `ready` for a slot."""
        for r in [r for r in self.parked if r in self.calls]:
            ep = self.episodes[r]
            if not self.calls[r].ready(ep.limits.timeout_s):
                continue
            fed = ep.respond(self.calls.pop(r))
            if fed is None:
                ended[r // self.Rb, self.parked.pop(r)] = True
                del self.parked_t[r]
            else:
                self.ready[r // self.Rb][r] = fed

    def waiting_on_environments(self) -> bool:
        return bool(self.calls)

    def _turn_end(self, r: int, t: int, paused: bool, tokens) -> int | None:
        """Where episode r's current turn ends: at the environment's tool-call closing tag if the
        model wrote one (the fewest tokens that contain it), else at `t` if the turn ended; None
        while it goes on."""
        tag = getattr(self.episodes[r].env, "tool_call_end", None)
        start = self.turn_start[r]
        if tag:
            text = self.tokenizer.decode(tokens[start:t].tolist(), skip_special_tokens=False)
            if tag in text:
                for k in range(1, t - start + 1):
                    if tag in self.tokenizer.decode(tokens[start:start + k].tolist(), skip_special_tokens=False):
                        return start + k
        return t if paused else None
