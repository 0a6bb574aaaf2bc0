"""Prompt data: seeded synthetic TFDS datasets and GSM8K, random-access sources, a
checkpointable per-process sampler, prompt formatting, and a character-level tokenizer.

```
load_source(name, split, data_dir=...)   rows as dicts (TFDS array_record, no TensorFlow)
load_path(path, eval_path=...)           your own rows (JSONL/JSON/CSV/Parquet, save_to_disk, TFDS dir)
IndexSampler(len(source), seed=...)      shuffled, sharded, resumable index order
PromptFormatter(tokenizer, ...)          row -> prompt ids (chat template or str.format)
PromptStream(source, sampler, fmt)       next_batch(n) -> [Example], state_dict()
```
"""

from grpo_jax.data.arithmetic import Arithmetic, ArithmeticConfig
from grpo_jax.data.countdown import Countdown, CountdownConfig
from grpo_jax.data.files import FileSource, load_path
from grpo_jax.data.gsm8k import Gsm8kLocal
from grpo_jax.data.prompts import Prompt, PromptFormatter
from grpo_jax.data.sampler import IndexSampler
from grpo_jax.data.source import DATASETS, DataSource, load_source
from grpo_jax.data.stream import Example, PromptStream, first_usable
from grpo_jax.data.synthetic import SyntheticConfig
from grpo_jax.data.tokenizer import DEFAULT_ALPHABET, char_tokenizer
from grpo_jax.data.word_problems import WordProblems, WordProblemsConfig

__all__ = [
    "DATASETS",
    "DEFAULT_ALPHABET",
    "Arithmetic",
    "ArithmeticConfig",
    "Countdown",
    "CountdownConfig",
    "DataSource",
    "Example",
    "FileSource",
    "first_usable",
    "Gsm8kLocal",
    "IndexSampler",
    "Prompt",
    "PromptFormatter",
    "PromptStream",
    "SyntheticConfig",
    "char_tokenizer",
    "load_source",
    "load_path",
    "WordProblems",
    "WordProblemsConfig",
]
