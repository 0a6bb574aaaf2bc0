"""RESULTS.md "The critique of GRPO, measured": the prose between the tables, whose figures are read from
the same summary.json files as the tables (results/critique/): the findings in short, and what the
control, the oracle, the critics' fits, the comparison and the retention runs show.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from figure_blocks import load


def _oracle(name: str) -> dict:
    return load(f"critique/{name}/summary.json")


def _ev(name: str, key: str = "oracle_prefix") -> float:
    """The explained variance of one of credit_oracle.py's values on one of its runs."""
    return _oracle(name)["explained_variance"][key]


def render_findings() -> str:
    """The section's opening list."""
    return (
        "1. Over-optimisation: against a small learned reward model the proxy rises in every run while\n"
        "   the gold judge (the strict verifier) peaks early and falls as KL grows; the largest KL\n"
        "   coefficient keeps more of the gold, beyond the seeds' noise. The report flags it.\n"
        "2. Retention: on SmolLM2-135M, 80 GRPO steps that took the task from a tenth to about half right\n"
        "   moved its next-token distributions on general text a little and more each evaluation (the KL\n"
        "   term halved that), and did not raise its NLL there; the report's notice stays silent.\n"
        "3. Hacking: a lenient numeric verifier is hacked (its own accuracy rises while the strict\n"
        "   verifier's ends below the strict-trained run's, paired by seed); \"the answer anywhere\" was not,\n"
        "   within 300 steps. The report flags the disagreement on every hacked run.\n"
        "4. A critic where credit must be assigned: on a chain whose first slip settles the reward, no\n"
        "   tuned critic learns the value (their explained variance stays near 0 where an oracle's table\n"
        f"   reaches {_ev('credit_oracle_shared'):.2f}), and no arm (PPO, VAPO, its parts) beats GRPO beyond three "
        "seeds' noise.\n"
        "5. Stability v3 (`benchmarks/stability_v3.py`: no leak, rates swept, 6 seeds, paired tests;\n"
        "   `benchmarks/stability.md`): only the random-reward control differs from GRPO beyond noise; the\n"
        "   seed's warm start moves the result more than any objective.\n")


def render_control_notes() -> str:
    """What the control's warm-ups show (results/critique/credit_control)."""
    runs = {(r["kind"], r["critic_lr"]): r for r in load("critique/credit_control/summary.json")["runs"]
            if r.get("stage") == "critic_lr"}
    good = runs[("model", 0.001)]
    return (f"So the critic model can learn a value when the prefix says the outcome ({good['ev_end']:.2f}, flat from "
            f"about\nstep {good['ev_plateau_step']} at 1e-3; at 1e-2 its explained variance falls to 0 within a few steps "
            "and stays there);\nthe value head (a linear read of the policy's last hidden state) does not at either rate, "
            "which\nsuggests (no probe tested it) that the policy's features do not carry the first token's parity\n"
            "where the head reads them.\n")


def render_oracle_notes() -> str:
    """What credit_oracle.py's four runs show."""
    last, deriv, long = _oracle("credit_oracle"), _oracle("credit_oracle_derivation"), _oracle("credit_oracle_derivation_sft1500")
    slip = last["first_slip_position"]
    best_last = max(last["explained_variance"][k] for k in ("oracle_prefix", "oracle_last"))
    return ("On the config's reward (the last total) the warm start slips early (character "
            f"{slip['median']:.0f} of 15-23, median,\nin {slip['rows_with_slip'] / last['rows']:.0%} of rows) and often "
            "recovers: it writes each total from the question, not only from its own\nlast total, so a slip does not "
            "settle the outcome and no value of the prefix that the oracle reads\n"
            f"explains more than {best_last:.2f} of the return. By what the oracle reads, the task as configured leaves a\n"
            "critic little credit to assign. With every total checked (`--reward derivation`, "
            "`critique_rewards.py:derivation_exact`),\nthe first slip does settle the outcome: the prefix-oracle explains "
            f"{deriv['explained_variance']['oracle_prefix']:.2f} and the group mean nothing\n(it is below 0: 7 group-mates "
            "are a noisy guess of a row whose outcome its own slip decides), the\nregime the critique means. A longer "
            "warm start (1500 SFT steps) nearly solves the chains (accuracy\n"
            f"{long['accuracy']:.2f}) and the group mean recovers part of the gap "
            f"({long['explained_variance']['group_mean']:.2f} against the oracle's "
            f"{long['explained_variance']['oracle_prefix']:.2f}): credit matters\nmost where the policy is still often "
            "wrong.\n")


def render_gap_notes() -> str:
    """Why no critic reaches the target: the oracle's lower bounds, and what a critic must learn."""
    deriv = _oracle("credit_oracle_derivation")
    return ("No critic comes near what the oracle shows is there: on the derivation reward the critic model\n"
            f"stays near 0 through 1000 steps against the oracle's {_ev('credit_oracle_derivation'):.2f}, and the value "
            "head below 0. The\ntarget (explained variance 0.3) is not met, and on this task it could not be by the\n"
            f"oracle's lower bound either ({_ev('credit_oracle_derivation'):.2f} at the config's warm start, "
            f"{_ev('credit_oracle_shared'):.2f} at the 800-step one the\ncomparison below shares, "
            f"{_ev('credit_oracle_derivation_sft1500'):.2f} at 1500 steps; the best value of the prefix may know more, "
            "from the prompt).\nWhy the critics fail where the control succeeded: to see that a derivation has slipped, "
            "a critic\nmust check the arithmetic, a function the policy it was copied from gets wrong in "
            f"{1 - deriv['accuracy']:.0%} of rows,\nlearned from binary returns with a {deriv['accuracy']:.0%} base rate; "
            "the control's outcome was readable from the\nfirst token. So the next critic started from a verifier: "
            "`benchmarks/credit_verifier.py` trains a\nreward model (`grpo-jax train-rm`, the 4-layer model of "
            "`configs/rm_demo_cpu.yaml`) on chain\nprefixes, the gold one against the same prefix with one total off by "
            "1-3 and carried on, and\nstarts the critic model from it (`ppo.critic_path`: its score head is the value head):\n")


def render_fit_notes() -> str:
    """What credit_fit.py's fits at rest show."""
    ls = load("critique/credit_fit/summary.json")["head_least_squares"]
    return ("Not the networks' capacity: the critic model fits the returns of the rows it is trained on (a third\n"
            "to almost half of their variance by step 400), while on other prompts its explained variance\n"
            "never rises above 0 and falls as it fits: from 128 prompts it learns which outcomes it has seen,\n"
            "not whether the arithmetic so far is right, which is what would carry to a new prompt. The frozen\n"
            f"policy's last states hold little linear trace of the value (the least-squares head explains {ls['fitted']:.2f}\n"
            f"of the rows it is fitted to and nothing of the held-out ones, at ridge {ls['ridge']:g}), so a value head on "
            "the policy, the PPO arm's critic, has little to read\nuntil the trunk changes. Online, a 100-step warm-up "
            "brings 3,200 prompts, 25 times the fit's, so\nthere is nothing to memorise, and the critics still explain ~0 "
            "(the warm-up tables above): more\nprompts did not give them the check either. What the critics would have to "
            "learn is an arithmetic\ncheck, from binary returns; these 2-layer, 128-wide networks did not learn it in any "
            "setting\ntried here (one seed each), and the target of 0.3 lies above even the oracle's table for this warm\n"
            "start. That is why the target is not met here.\n")


def _critic_ev(arm: str) -> float:
    """The mean over an arm's compared runs of its critic's explained variance over the last 10 steps."""
    runs = [r for r in load("critique/credit_shared/summary.json")["runs"] if r.get("stage") == "compare" and r["arm"] == arm]
    return float(np.mean([np.nanmean([np.nan if v is None else v for v in r["ev_curve"][-10:]]) for r in runs]))


def render_shared_notes() -> str:
    """What the comparison from the shared warm start shows."""
    shared = _oracle("credit_oracle_shared")["explained_variance"]
    return ("What it shows. From a warm start with about a third of the chains right every arm learns, to\n"
            "about seven in ten after 200 updates, and no arm differs from GRPO by more than the seeds' noise:\n"
            "Dr. GRPO and VAPO end where GRPO ends, PPO with a value head a few hundredths lower with an\n"
            "interval that reaches above 0. The sweep chose its lowest rate for GRPO and Dr. GRPO, so it did\n"
            "not bracket them from below (a lower rate might serve both better; the critic arms chose the\n"
            "middle one). The critics explain none of the return here either: the value head's explained\n"
            f"variance averages {_critic_ev('ppo'):.2f} over its runs and the critic model's {_critic_ev('vapo'):.2f}, "
            "where a table by\nposition and whether the prefix is still gold explains "
            f"{shared['oracle_prefix']:.2f} of it on this warm start's own\nrollouts and the group mean "
            f"{shared['group_mean']:.2f} (the oracle block above, its last column). A critic arm's\n"
            "advantage is then close to its return minus a constant, and VAPO's parts change nothing that\n"
            "three seeds can see: each of the five lands within two hundredths of VAPO on average (without\n"
            "the value warm-up its seeds spread widest; with three seeds the sign-flip test cannot go below\n"
            "p = 1/4; the t-test's p of 0 for the decoupled GAE is three equal differences of 5 in 512 answers). "
            "On this task at this scale the claim that GRPO needs a critic\nwhere credit must be assigned is not borne "
            "out: tuned critics do not learn the value that would\nassign it, and GRPO without one does as well as any "
            "arm with one.\n")


def render_retention_notes() -> str:
    """What the 80-step SmolLM2 retention runs show (results/critique/retention_smollm2_80)."""
    runs = {r["beta"]: r for r in load("critique/retention_smollm2_80/summary.json")["runs"]}
    with_kl = next(r for b, r in runs.items() if b > 0)["evals"][-1]
    return (f"In {with_kl['step']} steps held-out accuracy rose from about a tenth to a half without the KL term and to "
            f"{with_kl['eval/accuracy']:.2f}\nwith it (one seed, 128 answers each: that gap is within noise). "
            "The KL on general text grew\nthroughout: after step 40 it about doubled every 20 steps without the KL "
            "term and grew by about\nhalf every 20 steps with it, ending at about half the drift. The general NLL "
            "ended where it began\nwithout the KL term (it dipped, then turned up after step 40: the start of a cost, "
            "or noise, one\nseed cannot say) and a little below it with the term. What GRPO cost SmolLM2 elsewhere at "
            "this\nlength is a small, growing drift of its distributions on general text, which the KL term slows,\n"
            "not yet a loss of how well it models that text; the\nreport's `retention_loss` notice (`retention/kl` of "
            "`0.05` nats per token, or an NLL rise of `0.05`) stayed silent\non both, as it should this far below it. "
            "Where the NLL starts to rise (hundreds of steps, a larger\nlearning rate) is beyond this machine's budget for "
            "one run: each of these took about 55 minutes\n(both shared the cores for part of it, with credit_fit.py and "
            "a test or two).\n")


BLOCKS: dict[str, Callable[[], str]] = {
    "critique-findings": render_findings,
    "critique-credit-control-notes": render_control_notes,
    "critique-credit-oracle-notes": render_oracle_notes,
    "critique-credit-gap-notes": render_gap_notes,
    "critique-credit-fit-notes": render_fit_notes,
    "critique-credit-shared-notes": render_shared_notes,
    "critique-retention-smollm2-notes": render_retention_notes,
}
