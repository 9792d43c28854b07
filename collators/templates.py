"""Chat templates in four common formats, written for this package.

``CHATML_TEMPLATE`` is the template of the default tokenizer (``collators.load_default_tokenizer``). It wraps
every assistant turn, closing token included, in ``{% generation %}`` markers, so
``apply_chat_template(..., return_assistant_tokens_mask=True)`` reports the trained tokens directly.

The other three follow the layout of widely used model families and carry no generation markers; they
exercise the template-agnostic path of ``collators.tokenize_conversation``:

- ``LLAMA3_TEMPLATE``: ``<|start_header_id|>role<|end_header_id|>\\n\\n...<|eot_id|>``, tool results under the
  ``ipython`` role, tool calls as JSON.
- ``MISTRAL_TEMPLATE``: ``[INST] ... [/INST] answer</s>``; the system prompt is folded into the first user turn;
  tool calls after ``[TOOL_CALLS]``, results in ``[TOOL_RESULTS] ... [/TOOL_RESULTS]``.
- ``GEMMA_TEMPLATE``: ``<start_of_turn>user ... <end_of_turn>``, the assistant role is named ``model``, the system
  prompt is folded into the first user turn; no tool turns (the format has none).

All four render an assistant message's ``tool_calls`` (OpenAI layout:
``{"type": "function", "function": {"name": ..., "arguments": {...}}}``) with ``tojson``.
"""

CHATML_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['role'] == 'assistant' %}"
    "{%- generation %}"
    "{{- message['content'] if message['content'] is defined else '' }}"
    "{%- if message['tool_calls'] is defined %}"
    "{%- for call in message['tool_calls'] %}"
    "{{- '<tool_call>\\n' + call['function'] | tojson + '\\n</tool_call>' }}"
    "{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>' }}"
    "{%- endgeneration %}"
    "{{- '\\n' }}"
    "{%- else %}"
    "{{- message['content'] + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

LLAMA3_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if tools is defined and tools %}"
    "{{- '<|start_header_id|>system<|end_header_id|>\\n\\nYou can call these functions:\\n' }}"
    "{%- for tool in tools %}{{- tool | tojson + '\\n' }}{%- endfor %}"
    "{{- '<|eot_id|>' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- set role = 'ipython' if message['role'] == 'tool' else message['role'] %}"
    "{{- '<|start_header_id|>' + role + '<|end_header_id|>\\n\\n' }}"
    "{%- if message['tool_calls'] is defined %}"
    "{%- for call in message['tool_calls'] %}{{- call['function'] | tojson }}{%- endfor %}"
    "{%- else %}"
    "{{- message['content'] | trim }}"
    "{%- endif %}"
    "{{- '<|eot_id|>' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{%- endif %}"
)

MISTRAL_TEMPLATE = (
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set system_prompt = messages[0]['content'] + '\\n\\n' %}"
    "{%- set loop_messages = messages[1:] %}"
    "{%- else %}"
    "{%- set system_prompt = '' %}"
    "{%- set loop_messages = messages %}"
    "{%- endif %}"
    "{{- bos_token }}"
    "{%- if tools is defined and tools %}"
    "{{- '[AVAILABLE_TOOLS] ' + tools | tojson + '[/AVAILABLE_TOOLS]' }}"
    "{%- endif %}"
    "{%- for message in loop_messages %}"
    "{%- if message['role'] == 'user' %}"
    "{{- '[INST] ' + (system_prompt if loop.first else '') + message['content'] + ' [/INST]' }}"
    "{%- elif message['role'] == 'assistant' %}"
    "{%- if message['tool_calls'] is defined %}"
    "{{- '[TOOL_CALLS] [' }}"
    "{%- for call in message['tool_calls'] %}"
    "{{- call['function'] | tojson }}{%- if not loop.last %}{{- ', ' }}{%- endif %}"
    "{%- endfor %}"
    "{{- ']' + eos_token }}"
    "{%- else %}"
    "{{- ' ' + message['content'] + eos_token }}"
    "{%- endif %}"
    "{%- elif message['role'] == 'tool' %}"
    "{{- '[TOOL_RESULTS] ' + message['content'] + '[/TOOL_RESULTS]' }}"
    "{%- else %}"
    "{{- raise_exception('Unknown role: ' + message['role']) }}"
    "{%- endif %}"
    "{%- endfor %}"
)

GEMMA_TEMPLATE = (
    "{{- bos_token }}"
    "{%- if messages[0]['role'] == 'system' %}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' %}"
    "{%- set loop_messages = messages[1:] %}"
    "{%- else %}"
    "{%- set first_user_prefix = '' %}"
    "{%- set loop_messages = messages %}"
    "{%- endif %}"
    "{%- for message in loop_messages %}"
    "{%- if message['role'] not in ('user', 'assistant') %}"
    "{{- raise_exception('Gemma turns are user or assistant, got ' + message['role']) }}"
    "{%- endif %}"
    "{%- set role = 'model' if message['role'] == 'assistant' else 'user' %}"
    "{{- '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else '') }}"
    "{{- message['content'] | trim + '<end_of_turn>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<start_of_turn>model\\n' }}{%- endif %}"
)
