"""One lane of .ci/plain_install's config checks: `grpo-jax check` (the CLI's main, as the console
script calls it) on each config named, one after another in this interpreter, each config's output
in WORK/logs/<config>.log and each failing config's path appended to WORK/failed. One interpreter
per lane: the imports (JAX, transformers, TFDS: ~4 s of CPU) once, not once per config.

    python .ci/check_lane.py WORK CONFIG...
"""

import os
import sys
import traceback

from grpo_jax.cli import main

work = sys.argv[1]
for config in sys.argv[2:]:
    name = os.path.basename(config)
    command = "train-rm" if name.startswith("rm_") else "train"
    # A distillation config's teacher: the stand-in plain_install writes (config.json and tokenizer).
    extra = ["--set", f"distill.teacher={work}/teacher"] if "_distill" in name else []
    sys.stdout.flush()
    sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    with open(f"{work}/logs/{name}.log", "w") as log:
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
        try:
            code = main(["check", "--config", config, "--for", command, "--set", f"data.data_dir={work}/tfds", *extra])
        except KeyboardInterrupt:
            raise
        except BaseException:  # an exception or an exit fails this config; the lane goes on to the next
            traceback.print_exc()
            code = 1
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        os.close(saved[0])
        os.close(saved[1])
    if code:
        with open(f"{work}/failed", "a") as failed:
            failed.write(config + "\n")
