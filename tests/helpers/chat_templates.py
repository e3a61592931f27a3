"""Chat templates for the tools tests (written here, nothing downloaded): one that takes `tools`
(Qwen2.5's shape, trimmed) and SmolLM2-135M-Instruct's, which does not."""
from __future__ import annotations

# Qwen2.5's shape, trimmed: the functions in a system block of its own wording, calls and tool
# results in the template's own markup (the tool message shows the id it answers).
TOOLS_TEMPLATE = (
    "{% if tools %}{{ '<|im_start|>system\\n' }}"
    "{% if messages[0].role == 'system' %}{{ messages[0].content + '\\n' }}{% endif %}"
    "{{ 'TEMPLATE-TOOLS:\\n' }}{% for tool in tools %}{{ tool | tojson }}{% endfor %}{{ '<|im_end|>\\n' }}"
    "{% elif messages[0].role == 'system' %}{{ '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{% endif %}"
    "{% for message in messages %}"
    "{% if message.role == 'system' %}"
    "{% elif message.role == 'assistant' and message.tool_calls %}{{ '<|im_start|>assistant\\n' + message.content }}"
    "{% for tc in message.tool_calls %}{{ '<tool_call>' }}"
    "{{ {'name': tc.function.name, 'arguments': tc.function.arguments} | tojson }}{{ '</tool_call>' }}{% endfor %}"
    "{{ '<|im_end|>\\n' }}"
    "{% elif message.role == 'tool' %}"
    "{{ '<|im_start|>tool\\n[' + message.tool_call_id + ' ' + message.name + '] ' + message.content + '<|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
# SmolLM2-135M-Instruct's template: no tools.
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
