"""TRL's GRPOTrainer on the peers workload (benchmarks/configs/peers.yaml); run in .venv-trl.

    benchmarks/peers/.venv-trl/bin/python benchmarks/peers/trl_step.py --weights DIR --output OUT.json

One optimizer step = 8 prompts x 8 completions of exactly 128 tokens (generate with
min_new_tokens = max_new_tokens), rewards, the reference model's log-probs, one AdamW update over
all 64 completions (per_device_train_batch_size = --micro-batch-rows, default 64, with
gradient_accumulation_steps = 64 / that, so one generation and one AdamW step per step). A
TrainerCallback times each whole step (on_step_begin -> on_step_end); wrappers around the trainer's
own methods split it:
  sample_s  `_generate_single_turn` (transformers' generate over the 64 rows)
  ref_s     `_get_per_token_logps_and_entropies` called with the reference model
  train_s   the rest of the step after `_prepare_inputs` returns: policy forward + loss +
            backward + clip + AdamW (training_step + optimizer step)
  other_s   the rest of `_prepare_inputs`: tokenizing, decoding, rewards, advantages
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import workload as w


class _Timers:
    def __init__(self):
        self.step, self.sample, self.ref, self.prepare = [], [], [], []
        self._acc = {"sample": 0.0, "ref": 0.0, "prepare": 0.0}
        self._t0 = None
        self.completion_lengths: set[int] = set()
        self.prompt_lengths: set[int] = set()

    def add(self, key, dt):
        self._acc[key] += dt

    def begin(self):
        self._acc = dict.fromkeys(self._acc, 0.0)
        self._t0 = time.perf_counter()

    def end(self):
        self.step.append(time.perf_counter() - self._t0)
        self.sample.append(self._acc["sample"])
        self.ref.append(self._acc["ref"])
        self.prepare.append(self._acc["prepare"])


def _wrap(timers: _Timers, key: str, fn, when=None):
    def wrapped(*args, **kwargs):
        if when is not None and not when(*args, **kwargs):
            return fn(*args, **kwargs)
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        timers.add(key, time.perf_counter() - t0)
        return out
    return wrapped


def main() -> None:
    args = w.parse_args(__doc__)
    os.environ.setdefault("WANDB_DISABLED", "true")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")

    import datasets
    import torch
    import transformers
    import trl
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    total = args.warmup + args.steps
    tokenizer = AutoTokenizer.from_pretrained(args.weights)
    prompts = w.all_prompts(total)
    w.check_prompt_lengths(tokenizer, prompts)
    model = AutoModelForCausalLM.from_pretrained(args.weights, dtype=torch.float32)

    def digit_share(completions, **kwargs):
        return [w.digit_share(c) for c in completions]

    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="trl_peers_"),  # nothing is saved (save_strategy="no")
        max_steps=total,
        # One generation of 64 completions per optimizer step, its update in micro-batches of
        # --micro-batch-rows (steps_per_generation defaults to gradient_accumulation_steps).
        per_device_train_batch_size=args.micro_batch_rows,
        gradient_accumulation_steps=w.PROMPTS_PER_STEP * w.GROUP_SIZE // args.micro_batch_rows,
        num_generations=w.GROUP_SIZE,
        max_completion_length=w.COMPLETION_LEN,
        generation_kwargs={"min_new_tokens": w.COMPLETION_LEN},
        temperature=w.TEMPERATURE,
        beta=w.BETA,
        epsilon=w.EPSILON,
        num_iterations=w.NUM_ITERATIONS,
        loss_type="dapo",  # token mean over the batch, as grpo_jax's loss_agg: token_mean
        learning_rate=w.LEARNING_RATE,
        lr_scheduler_type="constant",
        optim="adamw_torch",
        weight_decay=0.0,
        max_grad_norm=w.MAX_GRAD_NORM,
        gradient_checkpointing=False,  # TRL's default is True
        activation_checkpointing=False,  # transformers 5.x's name for it
        bf16=False,
        fp16=False,
        use_cpu=True,
        report_to=[],
        logging_steps=10_000,
        save_strategy="no",
        eval_strategy="no",
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[digit_share],
        args=config,
        train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
        processing_class=tokenizer,
    )

    timers = _Timers()
    generate = trainer._generate_single_turn

    def generate_checked(prompt_ids, *a, **kw):
        timers.prompt_lengths.update(len(p) for p in prompt_ids)
        completion_ids, logprobs = generate(prompt_ids, *a, **kw)
        timers.completion_lengths.update(len(c) for c in completion_ids)
        return completion_ids, logprobs

    trainer._generate_single_turn = _wrap(timers, "sample", generate_checked)
    trainer._get_per_token_logps_and_entropies = _wrap(
        timers, "ref", trainer._get_per_token_logps_and_entropies,
        when=lambda model, *a, **kw: model is trainer.ref_model)
    trainer._prepare_inputs = _wrap(timers, "prepare", trainer._prepare_inputs)

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *a, **kw):
            timers.begin()

        def on_step_end(self, *a, **kw):
            timers.end()
            i = len(timers.step)
            print(f"step {i}{' (warm-up)' if i <= args.warmup else ''}: {timers.step[-1]:.2f} s "
                  f"(generate {timers.sample[-1]:.2f}, ref {timers.ref[-1]:.2f})", flush=True)

    trainer.add_callback(StepTimer())
    trainer.train()

    if timers.completion_lengths != {w.COMPLETION_LEN} or timers.prompt_lengths != {w.PROMPT_LEN}:
        raise SystemExit(f"completion lengths {sorted(timers.completion_lengths)}, prompt lengths "
                         f"{sorted(timers.prompt_lengths)}: expected {w.COMPLETION_LEN} and {w.PROMPT_LEN}")
    if len(timers.step) != total:
        raise SystemExit(f"timed {len(timers.step)} steps, expected {total}")
    k = args.warmup
    step, sample, ref, prepare = timers.step[k:], timers.sample[k:], timers.ref[k:], timers.prepare[k:]
    train = [s - p for s, p in zip(step, prepare)]
    other = [p - a - b for p, a, b in zip(prepare, sample, ref)]
    rec = w.record("trl", f"trl {trl.__version__}, transformers {transformers.__version__}, "
                   f"torch {torch.__version__} ({torch.get_num_threads()} threads)",
                   step, sample, ref, train,
                   notes="train_s = step - _prepare_inputs (policy forward/backward + AdamW); "
                         "other_s = decode, rewards, advantages", micro_batch_rows=args.micro_batch_rows)
    rec["other_s"] = other
    w.write_record(args.output, rec)


if __name__ == "__main__":
    main()
