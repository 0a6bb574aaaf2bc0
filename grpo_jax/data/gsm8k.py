"""GSM8K built offline from local copies of its jsonl files.

TFDS's own `gsm8k` builder downloads the four files from GitHub. `Gsm8kLocal` is the same
builder (same name, version, features and rows, so the prepared directory is interchangeable
with the stock one) that reads them from a manual directory instead. Rows have `question`,
`answer` (the full solution ending in `#### N`), and TFDS's split of the answer into
`annotation` and `short_answer`.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator
from pathlib import Path

from etils import epath
from tensorflow_datasets.text.gsm8k import gsm8k as tfds_gsm8k

SOURCE_URL = "https://github.com/openai/grade-school-math/tree/master/grade_school_math/data"
# Split name -> file name, exactly as TFDS's gsm8k builder names them.
FILES = {split: f"{split}.jsonl" for split in ("train", "test", "train_socratic", "test_socratic")}

Gsm8k = tfds_gsm8k.Gsm8k  # the stock, downloading builder


def missing_files(manual_dir: str | Path) -> list[str]:
    """File names of FILES absent from manual_dir."""
    return [name for name in FILES.values() if not (Path(manual_dir) / name).is_file()]


def missing_files_message(manual_dir: str | Path) -> str | None:
    """What is missing from manual_dir and how to fix it, or None when all files are there."""
    manual_dir = Path(manual_dir)
    if not manual_dir.is_dir():
        return (
            f"GSM8K manual_dir {manual_dir} does not exist; create it and put "
            f"{', '.join(FILES.values())} there (from {SOURCE_URL})"
        )
    missing = missing_files(manual_dir)
    if missing:
        return (
            f"GSM8K file(s) {', '.join(missing)} missing: expected "
            f"{', '.join(str(manual_dir / m) for m in missing)}; copy them from {SOURCE_URL}"
        )
    return None


def check_download_reachable() -> None:
    """Fail at once, saying what to do, when GitHub's file host cannot be resolved.

    Offline, TFDS's downloader retries for minutes before giving up; a failed DNS lookup is the
    usual offline symptom and answers in milliseconds. Skipped behind an HTTP(S) proxy, which
    may resolve names that this machine cannot.
    """
    if any(os.environ.get(k) for k in ("HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy")):
        return
    host = "raw.githubusercontent.com"
    try:
        socket.getaddrinfo(host, 443)
    except OSError as e:
        raise ConnectionError(
            f"cannot download GSM8K: {host} does not resolve ({e}). Offline, pass "
            f"manual_dir=DIR holding {', '.join(FILES.values())} (from {SOURCE_URL})"
        ) from e


class Gsm8kLocal(Gsm8k, skip_registration=True):
    """TFDS's gsm8k, built from `dl_manager.manual_dir` instead of downloading."""

    name = "gsm8k"  # same prepared-data directory as the stock builder
    MANUAL_DOWNLOAD_INSTRUCTIONS = (
        f"Put {', '.join(FILES.values())} from {SOURCE_URL} in the manual directory."
    )

    def _split_generators(self, dl_manager):
        manual_dir = Path(dl_manager.manual_dir)
        if message := missing_files_message(manual_dir):
            raise FileNotFoundError(message)
        return {split: self._generate_examples(manual_dir / name) for split, name in FILES.items()}

    def _generate_examples(self, path: epath.PathLike) -> Iterator[tuple[int, dict[str, str]]]:
        # Same rows as the stock builder, but a bad line names its file and line instead of
        # failing inside a tuple unpacking.
        with epath.Path(path).open() as f:
            for i, line in enumerate(f):
                try:
                    ex = json.loads(line)
                    annotation, short_answer = ex["answer"].split("#### ")
                    row = {
                        "question": ex["question"],
                        "answer": ex["answer"],
                        "annotation": annotation,
                        "short_answer": short_answer,
                    }
                except (ValueError, KeyError, TypeError, AttributeError) as e:
                    raise ValueError(
                        f"{path} line {i + 1}: expected a JSON object with string fields "
                        f"'question' and 'answer' (containing one '#### '): {e!r}"
                    ) from e
                yield i, row
