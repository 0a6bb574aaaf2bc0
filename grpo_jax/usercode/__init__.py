"""User code (environments, rewards) under time limits: in worker processes when the config names
it (`module:attr`, `path/to/file.py:attr`; grpo_jax.usercode.workers), else on the trainer's
bounded pool of threads (grpo_jax.usercode.calls). Imports neither JAX nor NumPy: worker processes
load it."""

from grpo_jax.usercode.calls import (Call, CallStopped, CallTimeout, add_stop_source, done_call, local_threads,
                                     remove_stop_source, start_local, stopping)
from grpo_jax.usercode.functions import UserFunction
from grpo_jax.usercode.loading import absolute_name, is_user_name, load_user_object
from grpo_jax.usercode.workers import WorkerLost, Workers

__all__ = ["Call", "CallStopped", "CallTimeout", "UserFunction", "WorkerLost", "Workers", "absolute_name",
           "add_stop_source", "done_call", "is_user_name", "load_user_object", "local_threads", "remove_stop_source",
           "start_local", "stopping"]
