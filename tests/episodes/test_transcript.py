"""Environment messages become tokens that extend the trajectory (grpo_jax.episodes.transcript): the
difference between renders with and without them, or, where a template breaks that (a thinking
template that drops earlier <think> blocks, one that trims the model's text), the documented
fallback that keeps the sampled tokens and renders only the new messages. SmolLM2's own template,
with its real tokenizer, is checked in tests/models/test_gguf.py (it loads that tokenizer anyway)."""

from __future__ import annotations

import pytest

from grpo_jax.data.tokenizer import char_tokenizer
from grpo_jax.episodes.transcript import extension, render

# Gemma 3's chat template (the instruction-tuned models'; the 270M GGUF we ship has none): roles
# alternate user/model, the content is trimmed, a system message joins the first user turn.
GEMMA3 = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}{%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{%- endif -%}"
    "{%- if (message['role'] == 'assistant') -%}{%- set role = 'model' -%}{%- else -%}{%- set role = message['role'] -%}"
    "{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else '') }}"
    "{{ message['content'] | trim }}{{ '<end_of_turn>\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\n' }}{%- endif -%}"
)
# Qwen3-style thinking template: an assistant turn's <think> block is dropped once a later user
# message exists (tool answers do not count), so a user reply rewrites the earlier turn.
THINKING = (
    "{%- set ns = namespace(last_user=-1) -%}"
    "{%- for m in messages -%}{%- if m.role == 'user' -%}{%- set ns.last_user = loop.index0 -%}{%- endif -%}"
    "{%- endfor -%}"
    "{%- for m in messages -%}{%- set c = m.content -%}"
    "{%- if m.role == 'assistant' and loop.index0 < ns.last_user and '</think>' in c -%}"
    "{%- set c = c.split('</think>')[-1].lstrip('\n') -%}{%- endif -%}"
    "{{- '<|im_start|>' + m.role + '\n' + c + '<|im_end|>\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}"
)
QUESTION = [{"role": "user", "content": "What is 12 + 35?"}]


def tokenizer(template):
    return char_tokenizer(add_bos=True, chat_template=template)


def check_assembles(tok, history, sampled, ext, full_messages):
    """The trajectory (prompt, sampled turn, environment tokens) is the fresh render of the whole
    conversation, token for token (the char tokenizer has one token per character)."""
    prompt = render(tok, history, generation_prompt=True)
    ids = tok(prompt, add_special_tokens=False)["input_ids"] + tok(sampled, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids + ext.ids) == render(tok, full_messages, generation_prompt=True)


def test_gemma3_extends_the_conversation_with_a_user_reply():
    tok = tokenizer(GEMMA3)
    reply = [{"role": "user", "content": "Wrong: 12 + 35 is not 46. Try again."}]
    ext = extension(tok, QUESTION, "12 + 35 = 46<end_of_turn>", "12 + 35 = 46", reply)
    assert ext.exact
    assert ext.text == "\n<start_of_turn>user\nWrong: 12 + 35 is not 46. Try again.<end_of_turn>\n<start_of_turn>model\n"
    check_assembles(tok, QUESTION, "12 + 35 = 46<end_of_turn>", ext,
                    [*QUESTION, {"role": "assistant", "content": "12 + 35 = 46"}, *reply])


def test_a_trimming_template_falls_back_to_rendering_the_new_messages_only():
    tok = tokenizer(GEMMA3)
    reply = [{"role": "user", "content": "Try again."}]
    sampled = "  46 \n<end_of_turn>"  # Gemma's template would render the turn trimmed: "46"
    ext = extension(tok, QUESTION, sampled, "  46 \n", reply)
    assert not ext.exact
    # The sampled text is kept as sampled; the template's own closing and the reply follow.
    assert ext.text == "\n<start_of_turn>user\nTry again.<end_of_turn>\n<start_of_turn>model\n"


def test_a_thinking_template_that_drops_earlier_thoughts_falls_back_and_tool_answers_extend():
    tok = tokenizer(THINKING)
    content = "<think>\n12 + 35: 2 + 5 = 7, 1 + 3 = 4</think>\n47"
    sampled = content + "<|im_end|>"
    user = [{"role": "user", "content": "Now add 3."}]
    ext = extension(tok, QUESTION, sampled, content, user)
    assert not ext.exact  # the user message drops the turn's <think> block from a fresh render
    assert ext.text == "\n<|im_start|>user\nNow add 3.<|im_end|>\n<|im_start|>assistant\n"
    tool = [{"role": "tool", "content": "47"}]
    ext = extension(tok, QUESTION, sampled, content, tool)
    assert ext.exact  # a tool answer keeps the thoughts: the plain difference
    check_assembles(tok, QUESTION, sampled, ext, [*QUESTION, {"role": "assistant", "content": content}, *tool])


def test_a_turn_that_ended_at_a_tool_call_gets_the_templates_closing():
    tok = tokenizer(THINKING)
    sampled = content = "<calculator>12 + 35</calculator>"  # no stop token: the tool call's closing tag ended it
    tool = [{"role": "tool", "content": "47"}]
    ext = extension(tok, QUESTION, sampled, content, tool)
    assert ext.exact and ext.text.startswith("<|im_end|>\n<|im_start|>tool\n47")
    check_assembles(tok, QUESTION, sampled, ext, [*QUESTION, {"role": "assistant", "content": content}, *tool])


def test_a_role_the_template_cannot_continue_with_is_a_clear_error():
    tok = tokenizer(GEMMA3)  # roles must alternate: a tool message after the model's turn is refused
    with pytest.raises(ValueError, match="does not extend a conversation with messages of role tool"):
        extension(tok, QUESTION, "46<end_of_turn>", "46", [{"role": "tool", "content": "47"}])


def test_the_control_token_regex_is_a_trie_that_matches_the_longest_token():
    """`trie_pattern` finds what the plain longest-first alternation finds, at a cost per character
    that does not grow with the number of tokens (Gemma 3 has 6,249 special ones)."""
    import random
    import re

    from grpo_jax.episodes.transcript import trie_pattern

    rng = random.Random(0)
    for _ in range(200):
        words = {"".join(rng.choice("<a|>") for _ in range(rng.randint(1, 5))) for _ in range(rng.randint(1, 8))}
        plain = re.compile("|".join(map(re.escape, sorted(words, key=len, reverse=True))))
        trie = re.compile(trie_pattern(words))
        for _ in range(10):
            text = "".join(rng.choice("<a|>b") for _ in range(rng.randint(0, 30)))
            assert [m.span() for m in trie.finditer(text)] == [m.span() for m in plain.finditer(text)], (words, text)
    assert re.compile(trie_pattern(["<|im_end|>", "<|im"])).findall("<|im_end|><|im_start|>") == ["<|im_end|>", "<|im"]
