"""A prefill: a chat whose last message, the assistant's, is continued rather than answered
(vLLM's `continue_final_message`; what Anthropic's Messages API makes of a conversation that ends
with the assistant's words). The template renders no new turn, and the answer is what follows."""

from __future__ import annotations

from typing import Any

import anthropic
import pytest
from django.contrib.auth.models import User
from rest_framework.authtoken.models import Token

from gpuportal.wire import reasoning
from inference.serving import Executor
from scheduling.api import completion_input
from scheduling.api.completion_input import Refused
from tests.scheduling.test_openai import client, replica, served  # noqa: F401

ASKED = [{"role": "user", "content": "Name a colour."}, {"role": "assistant", "content": "The colour is"}]
# A template with a generation prompt and an end to each turn, as real ones have.
TURNS = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def read(**body: Any) -> Any:
    return completion_input.parse(
        {"model": "tiny", "messages": ASKED, **body}, "chat", default_timeout_s=5, max_timeout_s=10
    )


def test_the_template_leaves_the_assistants_words_open_and_begins_no_new_turn():
    from inference.management.commands.make_tiny_model import build_tokenizer

    tokenizer = build_tokenizer()
    plain = Executor(None, tokenizer)
    assert plain.chat_prompt(ASKED, None, continued=True).splitlines()[-1] == "assistant: The colour is"
    assert plain.chat_prompt(ASKED, None).splitlines()[-1] == "assistant:", "answered: a new turn"

    tokenizer.chat_template = TURNS
    assert plain.chat_prompt(ASKED, None, continued=True).endswith("<|assistant|>The colour is")
    assert plain.chat_prompt(ASKED, None).endswith("The colour is<|end|><|assistant|>")


def test_a_continued_chat_is_asked_in_a_chat_of_the_assistants_words_alone():
    assert read(continue_final_message=True).params[reasoning.CONTINUE_FINAL] is True
    assert reasoning.CONTINUE_FINAL not in read(continue_final_message=False).params

    for body, why in (
        ({"messages": ASKED[:1], "continue_final_message": True}, "the last message must be the assistant's"),
        ({"messages": [*ASKED[:1], {"role": "assistant", "content": " "}], "continue_final_message": True},
         "the last message must be the assistant's"),
        ({"continue_final_message": "yes"}, "must be true or false"),
        ({"continue_final_message": True, "response_format": {"type": "json_object"}}, "an answer held to a format"),
        ({"continue_final_message": True, "guided_choice": ["red", "blue"]}, "an answer held to a format"),
    ):  # fmt: skip
        with pytest.raises(Refused) as refused:
            read(**body)
        assert refused.value.param == "continue_final_message" and refused.value.message.startswith(why)
    with pytest.raises(Refused, match="only in a chat"):
        completion_input.parse({"model": "tiny", "prompt": "x", "continue_final_message": True}, "generate",
                               default_timeout_s=5, max_timeout_s=10)  # fmt: skip


def test_a_continued_answer_is_what_follows_the_assistants_words_on_v1_and_on_anthropics_messages(
    client,  # noqa: F811
    served,  # noqa: F811
    live_server,
):
    tokenizer = served
    rendered = Executor(None, tokenizer).chat_prompt(ASKED, None, continued=True)

    # Greedy: the answer of the prompt the template leaves open, as a completion of its text.
    expected = client.completions.create(model="tiny", prompt=rendered, max_tokens=6).choices[0].text
    continued = client.chat.completions.create(
        model="tiny", messages=ASKED, max_tokens=6, extra_body={"continue_final_message": True}
    )
    answered = client.chat.completions.create(model="tiny", messages=ASKED, max_tokens=6)
    key = Token.objects.get(user=User.objects.get(username="alice")).key
    with anthropic.Anthropic(base_url=live_server.url, api_key=key, max_retries=0, timeout=30) as claude:
        prefilled = claude.messages.create(model="tiny", max_tokens=6, messages=ASKED)

    assert continued.choices[0].message.content == expected
    assert answered.choices[0].message.content != expected, "without it, a new turn: another answer"
    assert prefilled.content[0].text == expected, "Anthropic's: a conversation ending with the assistant's words"
