"""User code by name: `module:attr` (importable, the working directory first, as with `python -m`)
or `path/to/file.py:attr`; the trainer checks a name with it when it reads the config, and each
worker process (grpo_jax.usercode.workers) loads the object again with it."""

from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path


def is_user_name(name: object) -> bool:
    """`name` names user code (module:attr or file.py:attr), not a built-in."""
    return isinstance(name, str) and ":" in name


def absolute_name(name: str) -> str:
    """`name` with a file path made absolute (a worker started later, or after a chdir, finds it)."""
    where, _, attr = name.rpartition(":")
    return f"{Path(where).resolve()}:{attr}" if where.endswith(".py") else name


def load_user_object(name: str, *, what: str, member: str = "function"):
    """The object `name` points at (see the module docstring); ValueError naming `what` and saying
    what went wrong."""
    where, _, attr = name.rpartition(":")
    if not where or not attr.isidentifier():
        raise ValueError(f"{what} {name!r}: write user {what}s as module:{member} or path/to/file.py:{member}")
    try:
        if where.endswith(".py"):
            path = Path(where)
            if not path.is_file():
                raise ValueError(f"{what} {name!r}: no file {str(path.resolve())!r}")
            spec = importlib.util.spec_from_file_location(f"grpo_jax_user_{what}_{path.stem}", path)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            if "" not in sys.path and str(Path.cwd()) not in sys.path:
                sys.path.insert(0, str(Path.cwd()))  # as `python -m` would: the working directory's modules
            module = importlib.import_module(where)
    except ValueError:
        raise
    except Exception as e:  # noqa: BLE001 - any import error is the user's code; say which and why
        raise ValueError(f"{what} {name!r}: importing {where!r} failed: {type(e).__name__}: {e}") from None
    obj = getattr(module, attr, None)
    if obj is None:
        from grpo_jax.config import did_you_mean  # here: a worker process's start does not load the config

        public = sorted(k for k, v in vars(module).items() if callable(v) and not k.startswith("_"))
        raise ValueError(f"{what} {name!r}: {where!r} has no {attr!r}{did_you_mean(attr, public)}; "
                         f"its {member}s and classes: {', '.join(public) or 'none'}")
    if not callable(obj):
        raise ValueError(f"{what} {name!r}: {attr!r} in {where!r} is a {type(obj).__name__}, not a {member}")
    return obj
