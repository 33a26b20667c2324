"""Turning :class:`MathExample` records into prompt strings and prompt token ids."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from nemo_fp8.data.schema import MathExample

PROBLEM_PLACEHOLDER = "{problem}"

#: The most characters one token of a prompt is assumed to cover: a prompt longer than ``max_prompt_tokens x`` this
#: many characters cannot fit and is dropped before it is tokenized (a single 10 MB row took 24 s to tokenize,
#: growing faster than its length, only to be dropped). The character tokenizer of the tiny model covers 1 per
#: token; BPE vocabularies average about 4 on English text and less on maths and code, and while single tokens of
#: a dozen or more characters exist (runs of spaces or dashes), no text a math prompt is made of averages near 16.
#: The bound is generous on purpose: it only has to stop rows thousands of times too long, and tokenizing up to 16x
#: the limit's characters costs milliseconds.
MAX_CHARS_PER_TOKEN = 16


class PromptFormatter:
    """Format a math problem as a prompt string, either plain or through a chat template.

    Plain mode (``use_chat_template=False``) replaces ``{problem}`` in ``template`` with the
    problem text. The replacement is a literal substitution, not ``str.format``, so templates may
    contain other braces (e.g. ``"\\boxed{}"``) without escaping.

    Chat mode renders ``tokenizer.apply_chat_template(messages, tokenize=False,
    add_generation_prompt=True)``, where ``messages`` is:

    * ``example.messages`` when present (DAPO records, used verbatim; if ``system_prompt`` is
      set and those messages have no system message, it is prepended), else
    * ``[{"role": "system", ...}]`` (only if ``system_prompt``) + ``[{"role": "user",
      "content": template with the problem filled in}]``.

    Either way ``response_prefix`` is appended last: the start of every answer, prefilled so the model
    generates only the rest (an assistant-turn prefill); the reward scores ``response_prefix + response``
    (``PromptSample.response_prefix``, ``nemo_fp8.algorithms.grpo.rollout``).

    Args:
        template (str): Prompt template; must contain ``{problem}``.
        use_chat_template (bool): Render with the tokenizer's chat template.
        system_prompt (str | None): Optional system message for chat mode (ignored in plain mode).
        response_prefix (str): Text every answer starts with, written at the end of the prompt ("" for none).

    Raises:
        ValueError: ``template`` lacks ``{problem}``.
    """

    def __init__(self, template: str = PROBLEM_PLACEHOLDER, use_chat_template: bool = False,
                 system_prompt: str | None = None, response_prefix: str = "") -> None:
        if PROBLEM_PLACEHOLDER not in template:
            raise ValueError(f"prompt template must contain {PROBLEM_PLACEHOLDER!r}, got {template!r}")
        self.template = template
        self.use_chat_template = use_chat_template
        self.system_prompt = system_prompt
        self.response_prefix = response_prefix

    def fill_template(self, problem: str) -> str:
        """Return ``template`` with ``{problem}`` replaced by ``problem``.

        Args:
            problem (str): The problem text.

        Returns:
            str: The filled template.
        """
        return self.template.replace(PROBLEM_PLACEHOLDER, problem)

    def messages(self, example: MathExample) -> list[dict[str, str]]:
        """Return the chat messages used in chat mode for ``example`` (see class docstring).

        Args:
            example (MathExample): The problem.

        Returns:
            list[dict[str, str]]: Messages with ``role`` and ``content``.
        """
        if example.messages:
            msgs = [dict(m) for m in example.messages]
            if self.system_prompt is not None and msgs[0].get("role") != "system":
                msgs.insert(0, {"role": "system", "content": self.system_prompt})
            return msgs
        msgs = []
        if self.system_prompt is not None:
            msgs.append({"role": "system", "content": self.system_prompt})
        msgs.append({"role": "user", "content": self.fill_template(example.problem)})
        return msgs

    def format(self, example: MathExample, tokenizer: Any = None) -> str:
        """Format ``example`` as a prompt string.

        Args:
            example (MathExample): The problem.
            tokenizer (PreTrainedTokenizerBase | None): Needed in chat mode only.

        Returns:
            str: The prompt text (in chat mode it ends with the assistant generation prompt), then
            ``response_prefix``.

        Raises:
            ValueError: Chat mode with no tokenizer, or a tokenizer without a chat template.
        """
        return self._render(example, tokenizer) + self.response_prefix

    def _render(self, example: MathExample, tokenizer: Any) -> str:
        if not self.use_chat_template:
            return self.fill_template(example.problem)
        if tokenizer is None:
            raise ValueError("PromptFormatter(use_chat_template=True) needs a tokenizer")
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError(
                f"tokenizer {type(tokenizer).__name__} has no chat_template; "
                "set one or use use_chat_template=False"
            )
        prompt = tokenizer.apply_chat_template(
            self.messages(example), tokenize=False, add_generation_prompt=True
        )
        if not isinstance(prompt, str):
            raise ValueError(f"apply_chat_template(tokenize=False) returned {type(prompt).__name__}, expected str")
        return prompt


@dataclass
class PromptSample:
    """A formatted, tokenized prompt with its source example.

    Attributes:
        example (MathExample): The problem (its ``answer`` is the reward's ground truth).
        prompt (str): The prompt text given to the policy (ending with ``response_prefix``).
        prompt_token_ids (list[int]): Token ids of ``prompt``.
        response_prefix (str): The start of the answer the prompt prefills (``data.response_prefix``);
            the reward scores it followed by the generated response.
    """

    example: MathExample
    prompt: str
    prompt_token_ids: list[int]
    response_prefix: str = ""


def tokenize_prompts(
    examples: Sequence[MathExample],
    tokenizer: Any,
    formatter: PromptFormatter,
    max_prompt_tokens: int,
    *,
    add_special_tokens: bool = False,
) -> tuple[list[PromptSample], int]:
    """Format and tokenize examples, dropping prompts longer than ``max_prompt_tokens``.

    A prompt of more than ``max_prompt_tokens * MAX_CHARS_PER_TOKEN`` characters is dropped without being tokenized
    (it cannot fit; tokenizing a multi-megabyte row takes seconds to minutes); it is counted with the others.

    The prompt text is tokenized with ``add_special_tokens=False`` by default: a chat template
    already writes the BOS / special tokens into the text, and adding them again would double
    them. In plain mode, put any BOS the model needs into the template, or pass
    ``add_special_tokens=True``.

    Args:
        examples (Sequence[MathExample]): Problems to format.
        tokenizer (PreTrainedTokenizerBase): Any Hugging Face tokenizer.
        formatter (PromptFormatter): Formats each example.
        max_prompt_tokens (int): Keep prompts with at most this many tokens (> 0).
        add_special_tokens (bool): Passed to the tokenizer.

    Returns:
        tuple[list[PromptSample], int]: Kept samples (input order) and the number dropped.

    Raises:
        ValueError: ``max_prompt_tokens`` <= 0, or errors from :meth:`PromptFormatter.format`.
    """
    if max_prompt_tokens <= 0:
        raise ValueError(f"max_prompt_tokens must be > 0, got {max_prompt_tokens}")
    if not examples:
        return [], 0
    max_chars = max_prompt_tokens * MAX_CHARS_PER_TOKEN
    formatted = [(ex, formatter.format(ex, tokenizer)) for ex in examples]
    fitting = [(ex, prompt) for ex, prompt in formatted if len(prompt) <= max_chars]
    dropped = len(formatted) - len(fitting)
    if not fitting:
        return [], dropped
    all_ids = tokenizer([prompt for _, prompt in fitting], add_special_tokens=add_special_tokens)["input_ids"]
    kept: list[PromptSample] = []
    for (example, prompt), ids in zip(fitting, all_ids):
        if len(ids) > max_prompt_tokens:
            dropped += 1
            continue
        kept.append(PromptSample(example=example, prompt=prompt, prompt_token_ids=list(ids),
                                 response_prefix=formatter.response_prefix))
    return kept, dropped
