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
    """The arrays of one poll: for `host_update` and for `move_slots`, by slot, and by episode for
    the episodes the engine preempted while their environment worked (`turns.host_update`)."""

    def __init__(self, Z: int, J: int, U: int, Rb: int):
        self.release, self.forced = np.zeros((Z, J), bool), np.zeros((Z, J, U), np.int32)
        self.n, self.rewind = np.zeros((Z, J), np.int32), np.full((Z, J), -1, np.int32)
        self.park_to, self.load_from = np.full((Z, J), -1, np.int32), np.full((Z, J), -1, np.int32)
        self.ended = np.zeros((Z, J), bool)  # parked episodes the host ended, by spot
        self.ep_forced, self.ep_n = np.zeros((Z, Rb, U), np.int32), np.zeros((Z, Rb), np.int32)
        self.ep_end, self.ep_rewind = np.zeros((Z, Rb), bool), np.full((Z, Rb), -1, np.int32)

    def feed(self, z: int, j: int, ids) -> None:
        self.forced[z, j, :len(ids)], self.n[z, j] = ids, len(ids)

    def at_slot(self, z: int, j: int) -> Target:
        return Target(self, z, j, by_episode=False)

    def at_episode(self, z: int, i: int) -> Target:
        return Target(self, z, i, by_episode=True)

    @property
    def update_args(self) -> tuple:
        return self.release, self.forced, self.n, self.rewind, self.ep_forced, self.ep_n, self.ep_end, self.ep_rewind

    @property
    def move_args(self) -> tuple | None:
        moved = (self.park_to >= 0).any() or (self.load_from >= 0).any() or self.ended.any()
        return (self.park_to, self.load_from, self.ended) if moved else None

    @property
    def quiet(self) -> bool:
        """Nothing for the engine: no slot released, fed, rewound or moved."""
        return not (self.release.any() or (self.n > 0).any() or (self.rewind >= 0).any() or (self.ep_n > 0).any()
                    or self.ep_end.any() or (self.ep_rewind >= 0).any()) and self.move_args is None


class Target:
    """Where one answer goes: a slot (z, j), or an episode (z, i) out of its slot (the paged engine)."""

    def __init__(self, out: Answers, z: int, k: int, *, by_episode: bool):
        self.out, self.z, self.k, self.by_episode = out, z, k, by_episode

    def feed(self, ids) -> None:
        if self.by_episode:
            self.out.ep_forced[self.z, self.k, :len(ids)], self.out.ep_n[self.z, self.k] = ids, len(ids)
        else:
            self.out.feed(self.z, self.k, ids)

    def release(self) -> None:
        (self.out.ep_end if self.by_episode else self.out.release)[self.z, self.k] = True

    def rewind(self, t: int) -> None:
        (self.out.ep_rewind if self.by_episode else self.out.rewind)[self.z, self.k] = t


class TagSearch:
    """Where one episode's current turn first holds its environment's tool-call closing tag `tag`:
    the fewest tokens from the turn's start whose text contains it. Polled after every segment,
    it decodes only what is new since the last poll, with a margin of `window` tokens before it (a
    tag written across two polls), so a turn's search costs work linear in its length: a whole
    turn decoded at every poll, then each of its prefixes, was quadratic (seconds at 4k tokens).
    `window`: tokens enough to hold the tag even at four tokens a character (byte-level pieces)."""

    def __init__(self, tokenizer, tag: str):
        self.tokenizer, self.tag = tokenizer, tag
        self.window = 4 * len(tag) + 8
        self.start = self.seen = -1
        self.decoded = 0  # token ids decoded so far (the work; tests count it)

    def _text(self, tokens, a: int, b: int) -> str:
        self.decoded += b - a
        return self.tokenizer.decode(tokens[a:b].tolist(), skip_special_tokens=False)

    def end(self, tokens, start: int, t: int) -> int | None:
        """The position just after the tag in `tokens` (the turn's first `t - start` tokens from
        `start`), or None while the turn does not hold it. A new `start` is a new turn."""
        if start != self.start:
            self.start = self.seen = start
        if t <= self.seen:
            return None
        lo = max(start, self.seen - self.window)
        if self.tag not in self._text(tokens, lo, t):
            self.seen = t
            return None
        without, within = self.seen, t  # the text of tokens[lo:within] holds the tag, that of [lo:without] not
        while within - without > 1:
            mid = (without + within) // 2
            if self.tag in self._text(tokens, lo, mid):
                within = mid
            else:
                without = mid
        return within


class EpisodeHost:
    """Per episode: where its current turn starts, the environment call in flight and the poll it
    started at, and for a parked episode its spot, its position and its answer waiting for a slot.
    `park`: move an episode out of its slot when its environment is still working one poll after
    its turn ended and other episodes of its shard wait for a slot. An episode preempted while its
    environment worked is in no slot; its answer goes to the engine by episode."""

    def __init__(self, episodes, tokenizer, stop_ids, env_tokens: int, *, shards: int = 1, park: bool = True):
        self.episodes, self.tokenizer, self.stop_ids, self.U = episodes, tokenizer, set(stop_ids), env_tokens
        self.Rb = len(episodes) // shards
        self.turn_start = [0] * len(episodes)
        self.calls, self.since = {}, {}
        self.park, self.parks, self.polls = park, 0, 0
        self.parked, self.parked_t = {}, {}
        self.searches: dict[int, TagSearch] = {}  # episode -> its turn's tool-tag search
        self.ready = [{} for _ in range(shards)]  # per shard: episode -> the tokens to feed on loading

    def answer(self, ts) -> Answers:
        """What the engine is told after a segment (`turns.host_update`, `turns.move_slots`; `ts`
        the engine's turn state, read through its `host_view`)."""
        self.polls += 1
        st = ts.engine
        seq, mode, t, queued = (np.asarray(x) for x in ts.host_view())
        Z, J = seq.shape
        out = Answers(Z, J, self.U, self.Rb)
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
                self._slot(out.at_slot(z, int(j)), r, int(t[z, j]), bool(mode[z, j] == PAUSED), rows,
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
        self._preempted(out, ts, rows)
        return out

    def _slot(self, to: Target, r: int, t: int, paused: bool, rows, spots: list) -> None:
        """One episode in a slot (or out of one, `to`): its environment's answer, its turn's end, or
        (slow environment, in a slot) its move to a parking spot."""
        ep = self.episodes[r]
        if r in self.calls:
            if not self.calls[r].ready(ep.limits.timeout_s):
                if spots and self.since[r] < self.polls:
                    to.out.park_to[to.z, to.k] = self.parked[r] = spots.pop(0)
                    self.parked_t[r], self.parks = t, self.parks + 1
                return
            fed = ep.respond(self.calls.pop(r))
            if fed is None:
                to.release()
            else:
                to.feed(fed)
                self.turn_start[r] = t + len(fed)
            return
        if ep.error is not None:
            to.release()
            return
        tokens, logprobs = rows()
        end = self._turn_end(r, t, paused, tokens[r])
        if end is None:
            return
        cut = end < t  # at the tool call's closing tag, not at a stop token
        if cut:
            to.rewind(end)
        turn = tokens[r, self.turn_start[r]:end]
        call = ep.add_turn(turn.tolist(), logprobs[r, self.turn_start[r]:end].tolist(),
                           stopped=not cut and bool(turn.size) and int(turn[-1]) in self.stop_ids)
        if call is None:
            to.release()
        else:
            self.calls[r], self.since[r] = call, self.polls

    def _preempted(self, out: Answers, ts, rows) -> None:
        """Episodes the engine preempted out of their slot (waiting to be admitted again:
        neither in a slot nor parked), answered by episode as a slot would be (their turn's end, the
        tool call's cut, the environment's answer)."""
        ep_mode, ep_t, out_of_slot = (np.asarray(x) for x in ts.episode_view())
        for z, i in zip(*np.nonzero(out_of_slot)):
            r = z * self.Rb + int(i)
            self._slot(out.at_episode(int(z), int(i)), r, int(ep_t[z, i]), bool(ep_mode[z, i] == PAUSED), rows, [])

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
        if tag:
            search = self.searches.get(r)
            if search is None or search.tag != tag:
                search = self.searches[r] = TagSearch(self.tokenizer, tag)
            end = search.end(tokens, self.turn_start[r], t)
            if end is not None:
                return end
        return t if paused else None
